"""The transfer process does not re-run its parent's main module: under SGLang that is SGLang's
launcher (multiprocessing's spawn imports the parent's main module in the child before the target
runs), which doubled the child's start-up CPU in session 20's H200 run."""

import importlib.util
import sys
import types

from sglang_mori.backend import room_status as S

from transfer_process_rig import TransferProcessRig


def test_the_child_starts_without_importing_the_parents_main_module(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    module = tmp_path / "heavy_launcher_stand_in.py"
    module.write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the child gets the parent's sys.path
    main = types.ModuleType("__mp_main__")  # as in SGLang's scheduler: a spawned process runs the launcher
    main.__spec__ = importlib.util.spec_from_file_location("heavy_launcher_stand_in", module)
    main.__file__ = str(module)
    monkeypatch.setitem(sys.modules, "__main__", main)
    with TransferProcessRig() as rig:
        assert sys.modules["__main__"] is main  # put back after the start
        assert rig.claim(1) is None
        rig.metadata(1, pages=[2])
        rig.wait_status(1, S.WAITING_FOR_INPUT)
        rig.send(1, pages=[0], last=True)
        rig.wait_status(1, S.SUCCESS)
    assert not marker.exists()


def test_a_target_defined_in_the_main_script_still_starts(tmp_path, monkeypatch):
    """test/manual/hop_latency_cpu.py passes a child entry point defined in itself: the child needs
    the main module re-run to find it, so it is kept there."""
    from sglang_mori.transfer_process.client import TransferProcess
    from transfer_process_rig import SharedPools, child_spec

    module = tmp_path / "script_with_target.py"
    module.write_text("from sglang_mori.transfer_process.child import main as _child_main\n\n"
                      "def wrapped_child_main(spec, channel):\n    _child_main(spec, channel)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = types.ModuleType("__main__")  # as a script run directly: its functions pickle as __main__.<name>
    main.__spec__ = importlib.util.spec_from_file_location("script_with_target", module)
    main.__file__ = str(module)
    exec(compile(module.read_text(), str(module), "exec"), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    pools = SharedPools()
    try:
        process = TransferProcess(child_spec(pools), slots=16, target=main.wrapped_child_main)
        assert process.port > 0
        process.close()
    finally:
        pools.close()
