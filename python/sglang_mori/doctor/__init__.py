"""`sglang-mori doctor`: host checks for MORI-IO PD serving, one result line per check.

Every check reads the host through a `HostView` (sysfs, procfs, /boot, library directories,
environment), so tests point it at fake trees in a temporary directory. Nothing here imports torch,
sglang or mori into the doctor's own process: a broken ROCm install must not crash the doctor.
"""
