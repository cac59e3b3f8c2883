"""The master: the control plane. It keeps the index and never touches bytes."""
