"""The fixture the vLLM connector tests share: the model folder and the outputs without a
connector (greedy), which a run with the connector must equal. The rest they share is
vllm_harness.py (imported here only inside the fixture: importing it skips when vLLM is
absent, which a conftest must not)."""

import pytest


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """``(tmp, PROMPT's outputs, LONGER's outputs)``: tmp holds the model (tmp/model); the
    outputs are vllm_run.py's without a connector."""
    from vllm_harness import LONGER, PROMPT, run

    tmp = tmp_path_factory.mktemp("vllm")
    return tmp, run(tmp, "base_p", PROMPT), run(tmp, "base_long", LONGER)
