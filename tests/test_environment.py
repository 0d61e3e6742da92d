from optlab.core.machine.device import resolve_device
from optlab.core.machine.environment import capture, report


def test_environment_has_every_promised_field():
    env = capture(resolve_device("cpu"), "stand-in", "smoke")
    for key in ["python", "torch", "cuda", "cudnn", "gpu_name", "gpu_state", "cpu_count", "torch_threads",
                "data_source", "profile", "git_commit", "date"]:
        assert key in env
    assert env["torch_threads"] >= 1 and env["profile"] == "smoke" and env["data_source"] == "stand-in"
    assert len(report(env).splitlines()) == len(env)
