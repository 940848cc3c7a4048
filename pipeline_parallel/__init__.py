"""Pipeline parallelism: a dense MLP trained by any schedule, with data and tensor parallelism."""

from .executor import GradBuckets, TrainJob, train_program
from .functional import ACTIVATIONS, LOSSES
from .mlp import MLP, FitResult, ParameterServerFit
from .optim import OPTIMIZERS, Optimizer, OptimizerConfig

__all__ = ["MLP", "FitResult", "ParameterServerFit", "TrainJob", "train_program", "GradBuckets", "Optimizer",
           "OptimizerConfig", "OPTIMIZERS", "ACTIVATIONS", "LOSSES"]
from .gpt import (GPT, GPTConfig, GPTFitResult, ParallelConfig, forward_program,
                  llama_model_flops, megatron_flops_with_recompute, megatron_model_flops)

__all__ += ["GPT", "GPTConfig", "GPTFitResult", "ParallelConfig", "forward_program",
            "megatron_model_flops", "megatron_flops_with_recompute", "llama_model_flops"]
from .gpt import moe_groups, moe_model_flops

__all__ += ["moe_model_flops", "moe_groups"]
