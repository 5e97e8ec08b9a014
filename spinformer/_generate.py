"""Text generation from a trained character-level run (`spinformer generate RUN_DIR`)."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

from .config import ConfigError

VOCAB_FILE = "vocab.json"


class GenerateError(ConfigError):
    """A run directory or a prompt that generation cannot use; the message says what was
    wrong and how to fix it (printed as one line by the command)."""


def load_language_model(run_dir):
    """The trained model and vocabulary of a character-level run directory.

    **Returns:** `(cfg, chars, model)`: the run's config, its characters in id order (from
    `vocab.json` when the run saved one, else rebuilt from the training text) and the model
    of its newest intact checkpoint.

    Raises `GenerateError` for a missing directory, a directory that is not a run (no
    `config.yaml`), a run that is not a character language model, or one without a
    checkpoint.
    """
    from . import config as _config
    from . import train

    run = pathlib.Path(run_dir)
    if not run.exists():
        raise GenerateError(f"run directory {run} does not exist; pass the directory a "
                            "`spinformer run` wrote (runs/<config name> by default).")
    if not run.is_dir():
        raise GenerateError(f"{run} is a file, not a run directory.")
    if not (run / "config.yaml").exists():
        raise GenerateError(f"{run} is not a run directory (it has no config.yaml); pass the "
                            "directory a `spinformer run` wrote.")
    cfg = _config.load_config(run / "config.yaml")
    if cfg.data.task != "chars":
        raise GenerateError(f"{run} holds a run of data.task={cfg.data.task!r}; generation "
                            "works on character language models (data.task: chars).")
    vocab = run / VOCAB_FILE
    if vocab.exists():
        chars = json.loads(vocab.read_text(encoding="utf-8"))["chars"]
        dataset = _VocabOnly(chars, cfg.data.seq_len)
    else:
        dataset = train.build_dataset(cfg)
        chars = list(dataset.chars)
    try:
        _, _, model = train.load_run(run, dataset=dataset)
    except FileNotFoundError:
        raise GenerateError(f"{run} has no readable checkpoint yet; train it first (or "
                            "continue it with `spinformer run ... --resume`).") from None
    return cfg, chars, model


class _VocabOnly:
    """What `build_model` needs of a character dataset, from a saved vocabulary."""

    kind = "lm"

    def __init__(self, chars, seq_len):
        self.chars, self.seq_len = list(chars), seq_len
        self.vocab_size = self.num_classes = len(self.chars)


def encode_prompt(prompt: str, chars) -> list[int]:
    """The ids of `prompt`'s characters; a `GenerateError` names any character the model
    does not know."""
    if not prompt:
        raise GenerateError("the prompt is empty; pass at least one character with --prompt.")
    stoi = {c: i for i, c in enumerate(chars)}
    unknown = sorted({c for c in prompt if c not in stoi})
    if unknown:
        known = "".join(chars)
        raise GenerateError(f"the prompt holds characters outside the model's vocabulary: "
                            f"{', '.join(repr(c) for c in unknown)}; the vocabulary is "
                            f"{known!r}.")
    return [stoi[c] for c in prompt]


def generate_texts(run_dir, prompt: str, *, samples: Optional[int] = None, length: int = 200,
                   temperature: float = 0.8, seed: int = 0, incremental: bool = True,
                   progress: bool = False, loaded: Optional[tuple] = None,
                   decode_steps: Optional[int] = None) -> tuple[list[str], dict]:
    """Generate `length` characters after `prompt` with the model of a run directory.

    **Arguments:** `run_dir` (see `load_language_model`), `prompt` (characters of the
    model's vocabulary), `length`, `temperature` (0: greedy), `seed` (the same seed gives
    the same text), `incremental` (False: re-solve the context at every step, see
    `nn.generate`), `progress` (a tqdm bar), `loaded` (the result of `load_language_model`,
    to reuse a loaded model), `decode_steps` (solve each position with this many unrolled
    Picard steps at the model's own tolerance, `solvers.Picard(unroll=True)`: no while loop,
    faster on a GPU; solves that miss the tolerance are counted in `solver_failures`),
    `samples` (None: one text drawn with `key(seed)`; an int N: N continuations generated
    together as one batch, text b drawn with `jax.random.split(key(seed), N)[b]`; on a GPU
    a batch costs about as much per step as one text).

    **Returns:** `(texts, info)`: the generated characters (without the prompt), a list of
    one text or of `samples` texts, and `nn.generate`'s info (failures of all texts).
    """
    import jax

    from . import nn

    if length < 0:
        raise GenerateError(f"--length {length} must be >= 0.")
    if not temperature >= 0:
        raise GenerateError(f"--temperature {temperature} must be >= 0 (0: greedy).")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)
                                or samples < 1):
        raise GenerateError(f"--samples {samples!r} must be an int >= 1.")
    _, chars, model = loaded if loaded is not None else load_language_model(run_dir)
    ids = encode_prompt(prompt, chars)
    solver = None
    if decode_steps is not None:
        from . import solvers

        if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or (
                decode_steps < 1):
            raise GenerateError(f"--decode-steps {decode_steps!r} must be an int >= 1.")
        own = nn._decode.solvers_of(model)
        if not own:
            raise GenerateError("--decode-steps: this model's attention solves nothing; "
                                "drop the option.")
        solver = solvers.Picard(tol=float(own[0].tol), max_steps=decode_steps, unroll=True)
    try:
        prompts = jax.numpy.asarray(ids if samples is None else [ids] * samples)
        out, info = nn.generate(model, prompts, length=length,
                                temperature=temperature, key=jax.random.key(seed),
                                incremental=incremental, progress=progress, solver=solver)
    except ValueError as e:
        raise GenerateError(str(e)) from None
    rows = [out] if samples is None else out
    return ["".join(chars[i] for i in row) for row in rows], info
