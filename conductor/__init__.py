"""The conductor: KVCache-centric scheduling of prefill and decode (FAST'25 Algorithm 1),
early rejection, the cost model, and the OpenAI-compatible HTTP front."""
