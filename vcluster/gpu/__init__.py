"""Measurements on a real GPU with PyTorch: the kernel sweep behind
``vcluster hardware calibrate --gpu`` and the reference GPT step of ``vcluster bench
gpu-step``. Both also run on the CPU at tiny sizes, so CI exercises every line without
a GPU. torch is imported only when a measurement runs."""

from .calibration import calibrated_hardware, default_base
from .gpt_step import StepMeasurement, measure_gpt_step
from .kernel_sweep import KernelSweep, cuda_missing, sweep_kernels

__all__ = ["KernelSweep", "sweep_kernels", "cuda_missing", "calibrated_hardware",
           "default_base", "StepMeasurement", "measure_gpt_step"]
