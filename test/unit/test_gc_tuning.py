"""freeze_startup_heap freezes once per process and never again (objects made while serving stay
collectable). Run in a child interpreter: freezing this pytest process would change every test after."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc, json
    from sglang_mori.gc_tuning import freeze_startup_heap
    gc.disable()  # nothing may collect between our calls: counts must be exact
    class Node:
        pass
    cycle = Node(); cycle.me = cycle; del cycle  # garbage: collected, not frozen
    first = freeze_startup_heap("test")
    frozen_after_first = gc.get_freeze_count()
    later = [Node() for _ in range(1000)]  # made "while serving"
    second = freeze_startup_heap("test again")
    print(json.dumps({"first": first, "count1": frozen_after_first, "second": second,
                      "count2": gc.get_freeze_count(),
                      "young": sum(len(gc.get_objects(g)) for g in range(3))}))
    """
)


def test_freezes_the_startup_heap_once_and_nothing_made_later():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    # (A frozen object that dies leaves the permanent generation: counts may only go down.)
    assert got["first"] > 1000 and got["count1"] <= got["first"]
    assert got["second"] == 0
    assert got["count2"] <= got["count1"]  # the 1000 later objects were not frozen
    assert got["young"] >= 1000  # ...they are still in the collected generations
