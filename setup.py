"""Oases: overlapped and planned tensor-model parallelism for DeepSpeed, Lightning and Hydra."""
from setuptools import find_packages, setup

# Tested with transformers 5.24 (its rope_parameters config form; hf.py also reads the older
# rope_theta/rope_scaling form, but the tests build their tiny models with the new one).
HF = ["transformers>=5,<6", "safetensors>=0.4", "tokenizers>=0.20"]

setup(
    name="oases-ds",
    version="0.1.0",
    description="Overlapped, ILP-planned tensor model parallelism for training transformers on commodity servers",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["oases_ds", "oases_ds.*", "lightning_strategy", "lightning_strategy.*"]),
    # The Hydra configs travel inside the package so the CLIs work from a wheel, not only a clone.
    package_data={"oases_ds": ["configs/*.yaml", "configs/*/*.yaml"]},
    include_package_data=True,
    install_requires=[
        # torch is not pinned here: GPU users bring their CUDA build, CPU users take the [cpu] extra.
        "torch>=2.1",
        "deepspeed>=0.19.8,<0.20",  # OasesEngine relies on private hooks tested with 0.19.8
        "lightning>=2.6,<2.7",
        "ortools>=9.10",
        "hydra-core>=1.3,<1.4",
        "pyyaml",  # oases_ds.bench reads the config presets as plain YAML (Hydra stays in the CLIs)
        "pydantic>=2",
        "numpy",
        "scipy",  # the planner's cost-model accuracy study (Spearman rank correlation)
        "matplotlib",
    ],
    extras_require={
        # The CPU wheel of this pinned version; an unpinned torch resolves to a multi-GB CUDA build.
        "cpu": ["torch==2.13.0"],
        # Hugging Face import/export (oases_ds.hf) and tokenizers for oases-data; no model code is used.
        "hf": HF,
        "tensorboard": ["tensorboard>=2.10"],  # oases-train metrics.tensorboard=DIR (CSV needs nothing)
        "test": ["pytest>=7", "pytest-xdist>=3.5", *HF],
    },
    entry_points={
        "console_scripts": [
            "oases-train=oases_ds.cli.train:entry",
            "oases-plan=oases_ds.cli.plan:entry",
            "oases-bench=oases_ds.cli.bench:entry",
            "oases-data=oases_ds.cli.data:entry",
            "oases-ckpt=oases_ds.cli.ckpt:entry",
        ]
    },
)
