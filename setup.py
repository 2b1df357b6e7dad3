"""sglang-mori: MORI-IO KV-cache transfer backend for SGLang PD disaggregation (out-of-tree plugin)."""

from setuptools import find_packages, setup

setup(
    name="sglang-mori",
    version="0.1.0",
    description="MORI-IO KV-cache transfer backend for SGLang prefill-decode disaggregation",
    package_dir={"": "python"},
    packages=find_packages("python"),
    python_requires=">=3.10",
    install_requires=["numpy", "msgspec", "pyzmq", "prometheus-client"],
    entry_points={
        # SGLang calls every function in this group in each of its processes (sglang.srt.plugins).
        "sglang.srt.plugins": ["sglang_mori = sglang_mori.plugin:register"],
        "console_scripts": ["sglang-mori = sglang_mori.cli.main:main"],
    },
)
