"""An agent told to run its engines on a GPU it does not have says why and does not serve."""

from __future__ import annotations

import pytest
import torch
from agent_node_helpers import agent_args

from agents.node.launch import AgentProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device"),
]


def test_a_standalone_agent_on_a_missing_gpu_exits_with_the_reason():
    proc = AgentProcess(agent_args("prefill", "dc-a", "--device", "cuda"), "cuda")
    try:
        with pytest.raises(RuntimeError, match="exited \\(1\\) before ready") as exc:
            proc.start()
        assert "instance 0 failed to start" in str(exc.value)
        assert "torch sees no CUDA device" in str(exc.value)
    finally:
        proc.kill()
        proc.cleanup()


def test_a_bad_device_flag_is_a_usage_error(capsys):
    from agents.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "gpu"])
    assert exc.value.code == 2
    assert "device must be cpu, cuda or cuda:N" in capsys.readouterr().err
