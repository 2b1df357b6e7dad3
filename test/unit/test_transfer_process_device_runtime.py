"""The transfer process's own GPU runtime calls (transfer_process/device_runtime.py), against a fake
library: the child asks for blocking waits (CUDA's default spins the waiting thread on a core), and
HIP's calls are CUDA's under HIP's names."""

import ctypes

from sglang_mori.transfer_process import child, device_runtime


class FakeLib:
    """Records every call as (name, plain argument values); every call succeeds."""

    def __init__(self, prefix):
        self.calls = []
        self.prefix = prefix

    def __getattr__(self, name):
        if not name.startswith(self.prefix):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, [getattr(a, "value", a) for a in args]))
            return 0

        call.restype = None
        return call


def test_hip_waits_block_on_the_pool_device_with_schedule_blocking_sync():
    lib = FakeLib("hip")
    device_runtime.DeviceRuntime("hip", lib).block_on_waits(3)
    assert lib.calls == [("hipSetDevice", [3]), ("hipSetDeviceFlags", [4])]


def test_hip_pool_import_opens_the_handle_on_the_pool_device_with_lazy_peer_access():
    lib = FakeLib("hip")
    device_runtime.DeviceRuntime("hip", lib).open(b"h" * 64, 1)
    names = [name for name, _ in lib.calls]
    assert names == ["hipSetDevice", "hipIpcOpenMemHandle"]
    assert lib.calls[1][1][2] == 1  # hipIpcMemLazyEnablePeerAccess


def test_the_child_asks_for_blocking_waits_on_its_device(monkeypatch):
    asked = []

    class Runtime:
        def block_on_waits(self, device):
            asked.append(device)

    monkeypatch.setattr(device_runtime, "load", lambda: Runtime())
    child._block_on_gpu_waits(5)
    assert asked == [5]


def test_a_child_without_a_gpu_runtime_warns_and_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(device_runtime, "load", lambda: None)
    child._block_on_gpu_waits(0)
    assert "GPU waits will spin a core" in caplog.text


def test_the_ipc_handle_is_passed_by_value_as_64_bytes():
    assert ctypes.sizeof(device_runtime._IpcMemHandle) == device_runtime.IPC_HANDLE_BYTES == 64


def test_the_child_logs_info_even_where_the_root_logger_came_configured_at_warning(capfd):
    """Under SGLang the child found the root logger already set up (SGLang's format, a level above
    INFO): its start-up proof and first-Success lines never reached the server's log."""
    import logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        root.handlers[:] = [logging.StreamHandler()]
        root.setLevel(logging.WARNING)
        child.configure_logging(logging.INFO)
        logging.getLogger("sglang_mori.transfer_process.child_parts").info("registered and proven")
        err = capfd.readouterr().err
    finally:
        for handler in root.handlers:
            if handler not in saved[0]:
                root.removeHandler(handler)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "transfer-process INFO registered and proven" in err
