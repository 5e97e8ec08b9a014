"""Training: one pure step, evaluation, the loop with checkpoints and resume, reports.

`train` knows models only through their call signature; it never imports a specific
attention mechanism.
"""

from ._checkpoint import (
    CorruptCheckpoint,
    list_checkpoints,
    load_latest,
    read_checkpoint,
    save_checkpoint,
)
from ._diagnose_run import diagnose, diagnostics_table
from ._build import build_dataset, build_model, build_objective, build_optimizer
from ._experiment import load_run, run
from ._flops import StepFlops, step_flops
from ._loop import StopSignals, TrainingInterrupted, fit, read_metrics
from ._mesh import initialize_distributed, is_writer, make_mesh
from ._report import report
from ._rundir import RunDirError
from ._objective import Objective, evaluate, init_stream_state, loss_fn, solver_effect
from ._optim import make_optimizer, make_schedule, num_params
from ._state import RunState
from ._step import jit_step, make_step

__all__ = [
    "CorruptCheckpoint",
    "Objective",
    "RunDirError",
    "RunState",
    "StepFlops",
    "StopSignals",
    "diagnose",
    "TrainingInterrupted",
    "initialize_distributed",
    "is_writer",
    "make_mesh",
    "build_dataset",
    "build_model",
    "build_objective",
    "build_optimizer",
    "evaluate",
    "solver_effect",
    "fit",
    "diagnostics_table",
    "init_stream_state",
    "jit_step",
    "list_checkpoints",
    "load_latest",
    "load_run",
    "loss_fn",
    "make_optimizer",
    "make_schedule",
    "make_step",
    "num_params",
    "read_checkpoint",
    "step_flops",
    "read_metrics",
    "report",
    "run",
    "save_checkpoint",
]
