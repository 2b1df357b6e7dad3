"""Modules the forkserver imports once, so each harness worker forks with SGLang already loaded
(about 4 s of imports per worker otherwise, on a 2-core machine).

Only libraries: no plugin is loaded, no server arguments are published and no thread is started
here; every worker does its own set-up after the fork (pd/sglang_setup.setup_process).
"""

import numpy  # noqa: F401
import torch  # noqa: F401
import zmq  # noqa: F401

import sglang.srt.disaggregation.base.conn  # noqa: F401
import sglang.srt.disaggregation.common.conn  # noqa: F401
import sglang.srt.disaggregation.utils  # noqa: F401
import sglang.srt.runtime_context  # noqa: F401
import sglang.srt.server_args  # noqa: F401
