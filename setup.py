"""The one compiled part of the appliance: the fused CPU quantizers (appliance/quant/_quantize.c).

Everything else is in pyproject.toml. The extension is optional: without a C compiler and
Python's headers the install still succeeds, and --base-quant quantizes with PyTorch (the same
codes, ~5x slower; `appliance doctor` says which is in use)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "appliance.quant._quantize",
            ["appliance/quant/_quantize.c"],
            # exact IEEE arithmetic: no -ffast-math, no fused multiply-adds
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
