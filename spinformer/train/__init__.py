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
from ._diagnose import diagnose, diagnostics_table
from ._experiment import (
    RunDirError,
    build_dataset,
    build_model,
    build_objective,
    build_optimizer,
    check_run_dir,
    load_run,
    run,
)
from ._figures import plot_run, plot_runs
from ._loop import StopSignals, TrainingInterrupted, fit, read_metrics, skipped_steps_note
from ._mesh import initialize_distributed, is_writer, make_mesh
from ._report import report
from ._objective import Objective, evaluate, init_stream_state, loss_fn
from ._optim import init_opt_state, make_optimizer, make_schedule, num_params, params_of
from ._precision import mixed_precision
from ._state import RunState
from ._step import jit_step, make_step

__all__ = [
    "CorruptCheckpoint",
    "Objective",
    "RunDirError",
    "RunState",
    "StopSignals",
    "check_run_dir",
    "diagnose",
    "TrainingInterrupted",
    "initialize_distributed",
    "is_writer",
    "make_mesh",
    "mixed_precision",
    "build_dataset",
    "build_model",
    "build_objective",
    "build_optimizer",
    "evaluate",
    "fit",
    "diagnostics_table",
    "init_opt_state",
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
    "params_of",
    "plot_run",
    "plot_runs",
    "read_checkpoint",
    "read_metrics",
    "skipped_steps_note",
    "report",
    "run",
    "save_checkpoint",
]
