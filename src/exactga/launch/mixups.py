"""Launches that would run something other than what was asked, refused in one message.

Note [launch mix-ups]
``tune run`` resolves its recipe argument one of three ways: a name ``tune ls`` lists (a file of
torchtune's, or exactga's under ``exactga/``: see exactga.launch.registry), else a path turned
into a dotted module name and imported. Several ordinary commands then train something other
than asked, with exit status 0, or end in a traceback that does not say what to type instead:

- a single-device-only recipe by path (PPO, or a user's copy of it) under ``--nproc_per_node
  N``: torchtune refuses single-device recipes it knows by name, but a path is imported under
  torchrun as any script, so N processes each train the whole run into one output folder.
  The recipe refuses it itself, before anything is written: ``run_recipe`` asks
  :func:`single_device_problem`, which reads the recipe's ``RECIPE_NAME`` (a copy keeps it) or
  its source (a copy that renamed it still calls ``Runtime.single_device``);
  ``Runtime.single_device`` refuses too, for a copy that skips ``run_recipe``. A file that
  serves both of torchtune's names (``recipes/full_finetune.py``) trains on every rank under
  torchrun instead, whatever its config (see [one recipe, two launches] in
  exactga.launch.twins);
- a stock recipe name with a config written for exactga (``tune run lora_finetune_single_device
  --config configs/qwen3/0.6B_lora_single_device.yaml``): torchtune's own recipe runs and ignores
  exactga's keys (:data:`~exactga.launch.registry.EXACTGA_ONLY_KEYS`). Refused by the launcher
  (:func:`tune_run_problem`) where exactga has a recipe of that name, with the command that runs
  it; a stock config carries none of those keys, so stock runs are untouched;
- a recipe by a path that is no dotted module name (``/abs/recipes/x.py``, ``./x.py``,
  ``../x.py``, ``my-recipe.py``): torchtune's ``python -m`` form fails in runpy or torchrun. The
  launcher runs such a file by its path instead, as torchtune runs its own recipes
  (:func:`path_only_recipe`);
- a recipe that is neither a listed name, nor a file, nor a module (a typo in
  ``exactga/full_finetune_single_devic``, ``recipes/x.py`` from a folder without ``recipes/``):
  one message naming the nearest names instead of runpy's traceback;
- an exactga single-device recipe name under torchrun: torchtune's own refusal, with its
  distributed twin named (for the four families with one file, the same file's other name);
- a config whose ``loss`` is another recipe family's (a DPO config given to a fine-tuning recipe,
  or back): a traceback at the first batch, or start-up; refused by ``run_recipe``
  (:func:`recipe_family_problem`) with the recipe that trains it; likewise a LoRA model given to
  a recipe that trains every weight (:func:`lora_model_problem`);
- a torchrun option after the recipe (``tune run <recipe> --nproc_per_node 2 ...``): ``tune run``
  hands it to the recipe and starts one process (:func:`misplaced_torchrun_options`);
- several nodes without a rendezvous endpoint (``tune run --nnodes 2 --nproc_per_node 8
  --node_rank 0 --master_addr ... <recipe>``, torchrun's static form): ``tune run`` switches to
  torchrun's ``--standalone`` whenever ``--rdzv_endpoint`` is missing, so each node waits alone
  for the others and the launch ends after torch's join timeout (10 minutes) without training a
  step (:func:`several_nodes_without_rendezvous`; docs/meshes.md, "Several nodes").
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from exactga.launch.registry import (
    EXACTGA_ONLY_KEYS,
    PREFIX,
    RECIPES,
    distributed_twin,
    recipe_entry,
    recipe_of_config,
)
from exactga.launch.stopping import LAUNCH_COMMAND_ENV

# --- in the recipe: a single-device recipe under torchrun ----------------------------------


def single_device_problem(recipe_file: Path, recipe_globals: Mapping[str, Any]) -> str | None:
    """The message refusing a single-device recipe launched as one of several processes
    (``WORLD_SIZE`` above 1: ``--nproc_per_node``, ``--nnodes``), else None. See
    [launch mix-ups]."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    name = recipe_globals.get("RECIPE_NAME")
    entry = recipe_entry(name) if isinstance(name, str) else None
    if entry is not None and entry.supports_distributed:
        return None
    if entry is None and not _calls_single_device_runtime(recipe_file):
        return None
    label = recipe_file.name
    if entry is not None and recipe_file.stem != name:
        label += f" (a copy of {name})"
    command = _launch_command()
    typed = _typed_recipe(command, recipe_file) if command else None
    twin = distributed_twin(name) if entry is not None else None
    suggestion = _with_recipe(command, typed, PREFIX + twin) if typed and twin else None
    return single_device_refusal(label, twin, world_size, suggestion, known=entry is not None)


def single_device_refusal(
    recipe: str,
    twin: str | None,
    world_size: int | None,
    suggestion: str | None,
    known: bool = True,
) -> str:
    """The one message for a single-device recipe under torchrun: what would go wrong and the
    command to type instead (``suggestion``: the launch as typed, with the twin); ``known``:
    whether the recipe is exactga's or a copy that kept its ``RECIPE_NAME``."""
    if world_size:
        what = (
            f"{recipe} trains on one device, but this launch starts {world_size} processes "
            "(--nproc_per_node, --nnodes): each would train the whole run on its own, into "
            "the same output folder."
        )
    else:  # by name: refused before any process starts, as torchtune refuses its own
        what = f"{recipe} trains on one device and takes no torchrun options (--nproc_per_node)."
    if twin is None and known:
        return f"{what} exactga has no distributed version of it: run it without torchrun options."
    if twin is None:
        return (
            f"{what} Run it without torchrun options, or run a distributed recipe "
            f"('tune ls' lists exactga's: {PREFIX}<name>_distributed)."
        )
    if suggestion is None:
        suggestion = f"tune run --nproc_per_node N {PREFIX}{twin} --config <config> ..."
    return (
        f"{what} Run its distributed twin, {twin} ({_recipe_file(twin)} in exactga's folder): "
        f"{suggestion}; or run this one without torchrun options."
    )


def _recipe_file(name: str) -> str:
    """The file of exactga's recipe ``name``, as the docs give it (``recipes/x.py``)."""
    entry = recipe_entry(name)
    return f"recipes/{entry.recipe_file if entry is not None else name}.py"


def _calls_single_device_runtime(recipe_file: Path) -> bool:
    """Whether a recipe's source sets up a one-device run (``Runtime.single_device``) and no
    distributed one: a copy whose ``RECIPE_NAME`` was renamed or dropped."""
    try:
        source = recipe_file.read_text()
    except OSError:
        return False
    return "Runtime.single_device(" in source and "Runtime.distributed(" not in source


def _launch_command() -> list[str] | None:
    """The ``tune run`` command line the launcher was given (see [torchrun and a stop] in
    exactga.launch.cli), or None under a plain torchrun."""
    typed = os.environ.get(LAUNCH_COMMAND_ENV)
    if not typed:
        return None
    try:
        command = json.loads(typed)
    except json.JSONDecodeError:
        return None
    return command if isinstance(command, list) and "run" in command else None


def _with_recipe(command: Sequence[str], typed: str, recipe: str) -> str | None:
    """``tune run ...`` as typed in ``command``, with its recipe argument ``typed`` replaced by
    ``recipe``; None where ``typed`` is not among its arguments."""
    args = list(command)
    if "run" not in args:
        return None
    args = args[args.index("run") + 1 :]
    if typed not in args:
        return None
    args[args.index(typed)] = recipe
    return shlex.join(["tune", "run", *args])


def _typed_recipe(command: Sequence[str], recipe_file: Path) -> str | None:
    """The argument of ``tune run`` that named ``recipe_file`` (the ranks share the
    launcher's working directory)."""
    for arg in list(command)[list(command).index("run") + 1 :]:
        if arg.endswith(".py") and Path(arg).resolve() == recipe_file.resolve():
            return arg
    return None


# --- in the recipe: a config of another recipe family ---------------------------------------

# Each fine-tuning recipe and the preference recipe that takes the same model and split, and
# back (None: there is none; a DPO config is then pointed to lora_dpo_single_device).
_PREFERENCE_RECIPE_OF = {
    "full_finetune_single_device": None,
    "full_finetune_distributed": "full_dpo_distributed",
    "lora_finetune_single_device": "lora_dpo_single_device",
    "lora_finetune_distributed": "lora_dpo_distributed",
    "qat_distributed": None,
    "qat_lora_finetune_distributed": None,
}
_FINE_TUNING_RECIPE_OF = {
    "full_dpo_distributed": "full_finetune_distributed",
    "lora_dpo_single_device": "lora_finetune_single_device",
    "lora_dpo_distributed": "lora_finetune_distributed",
}
# ``loss._component_`` values by the objective they train (a prefix each; a user's own loss
# matches none and is left alone).
_PREFERENCE_LOSSES = (
    "torchtune.rlhf.loss.DPOLoss",
    "torchtune.rlhf.loss.RSOLoss",
    "torchtune.rlhf.loss.dpo.",
    "exactga.dpo.",
)
_POLICY_LOSSES = (
    "torchtune.rlhf.loss.PPOLoss",
    "torchtune.rlhf.loss.ppo.",
    "torchtune.dev.grpo.",
    "exactga.grpo.",
)
_TOKEN_LOSSES = (
    "torchtune.modules.loss.CEWithChunkedOutputLoss",
    "torchtune.modules.loss.ce_chunked_output_loss.",
    "exactga.accumulation.linear_cross_entropy.",
    "torch.nn.CrossEntropyLoss",
    "torch.nn.modules.loss.CrossEntropyLoss",
)


def recipe_family_problem(
    recipe_name: object, loss_component: object, recipe_args: Sequence[str]
) -> str | None:
    """The message refusing a config whose ``loss`` trains another recipe family's objective (a
    DPO config given to a fine-tuning recipe, or back), else None: such a run ends in a
    traceback at its first batch, or trains the wrong objective. ``recipe_args``: the recipe's
    own command-line arguments (``--config`` and the overrides), for the command to type."""
    if not isinstance(recipe_name, str) or not isinstance(loss_component, str):
        return None
    key = f"config key 'loss._component_' ({loss_component})"
    if recipe_name in _PREFERENCE_RECIPE_OF and loss_component.startswith(_PREFERENCE_LOSSES):
        twin = _PREFERENCE_RECIPE_OF[recipe_name] or "lora_dpo_single_device"
        return (
            f"{key} is a preference loss, for a DPO recipe; {recipe_name} trains on "
            f"next-token cross-entropy. Run a DPO recipe with this config: "
            f"{_launch_with(PREFIX + twin, recipe_args)}"
        )
    if recipe_name in _PREFERENCE_RECIPE_OF and loss_component.startswith(_POLICY_LOSSES):
        return (
            f"{key} is a policy-gradient loss, for {PREFIX}grpo_full_finetune_distributed or "
            f"{PREFIX}ppo_full_finetune_single_device; {recipe_name} trains on next-token "
            "cross-entropy. Give it a fine-tuning config, or run one of those."
        )
    if recipe_name in _FINE_TUNING_RECIPE_OF and loss_component.startswith(_TOKEN_LOSSES):
        twin = _FINE_TUNING_RECIPE_OF[recipe_name]
        return (
            f"{key} is a next-token cross-entropy, for a fine-tuning recipe; {recipe_name} "
            f"trains on preference pairs. Run a fine-tuning recipe with this config: "
            f"{_launch_with(PREFIX + twin, recipe_args)}"
        )
    return None


# Each recipe that trains every weight and its LoRA counterpart.
_LORA_RECIPE_OF = {
    "full_finetune_single_device": "lora_finetune_single_device",
    "full_finetune_distributed": "lora_finetune_distributed",
    "qat_distributed": "qat_lora_finetune_distributed",
    "full_dpo_distributed": "lora_dpo_distributed",
}


def lora_model_problem(
    recipe_name: object, model_component: object, recipe_args: Sequence[str]
) -> str | None:
    """The message refusing a LoRA model (a ``lora_``/``qlora_`` builder) given to a recipe that
    trains every weight, else None: its checkpoint holds no adapter weights, and the run would
    end on a long list of missing keys after writing its first files."""
    if recipe_name not in _LORA_RECIPE_OF or not isinstance(model_component, str):
        return None
    builder = model_component.rsplit(".", 1)[-1]
    if not builder.startswith(("lora_", "qlora_")):
        return None
    twin = _LORA_RECIPE_OF[str(recipe_name)]
    return (
        f"config key 'model._component_' ({model_component}) builds a LoRA model; "
        f"{recipe_name} trains every weight of a plain one. Run its LoRA recipe with this "
        f"config: {_launch_with(PREFIX + twin, recipe_args)}"
    )


def _launch_with(recipe: str, recipe_args: Sequence[str]) -> str:
    """``tune run`` of ``recipe`` with the launch's torchrun options (as the launcher was
    given them, where known) and the recipe's arguments."""
    command = _launch_command()
    torchrun_options: list[str] = []
    if command is not None:
        args = command[command.index("run") + 1 :]
        first_recipe_arg = next(
            (i for i, arg in enumerate(args) if i > 0 and arg == "--config"), len(args)
        )
        torchrun_options = args[: max(first_recipe_arg - 1, 0)]
    return shlex.join(["tune", "run", *torchrun_options, recipe, *recipe_args])


# --- in the launcher: tune run's recipe argument -------------------------------------------


def path_only_recipe(recipe: str) -> Path | None:
    """The file a recipe argument names where torchtune's ``python -m`` form cannot import it
    (its path is no dotted module name: absolute, ``./``, ``../``, a ``-`` in a name), else
    None: such a file is run by its path (see [launch mix-ups])."""
    path = Path(recipe)
    if path.suffix != ".py" or not path.is_file():
        return None
    dotted = os.path.splitext(recipe)[0].replace("/", ".")
    if all(part.isidentifier() for part in dotted.split(".")):
        return None
    return path.resolve()


def tune_run_problem(
    recipe: str,
    config_file: str | None,
    distributed: bool,
    listed: Mapping[str, bool],
) -> str | None:
    """The message refusing a ``tune run`` launch that would run something other than asked,
    else None. ``recipe`` is the argument as typed, ``config_file`` ``--config``'s file (a
    listed name already turned into its path), ``distributed`` whether torchrun options were
    given, ``listed`` every name ``tune ls`` lists, each with whether it supports torchrun."""
    if recipe.startswith(PREFIX) and recipe in listed:
        entry = recipe_entry(recipe.removeprefix(PREFIX))
        if distributed and entry is not None and not entry.supports_distributed:
            twin = distributed_twin(entry.name)
            suggestion = _with_recipe(_typed_command(), recipe, PREFIX + twin) if twin else None
            return single_device_refusal(recipe, twin, None, suggestion)
        return None
    if recipe in listed:
        return _stock_recipe_with_exactga_config(recipe, config_file)
    if path_only_recipe(recipe) is None and not _importable(recipe):
        return _no_such_recipe(recipe, listed)
    return None


def misplaced_torchrun_options(
    recipe: str, recipe_args: Sequence[str], options: Mapping[str, bool]
) -> str | None:
    """The message refusing torchrun options given after the recipe (``tune run <recipe>
    --nproc_per_node 2 ...``), which ``tune run`` hands to the recipe, so the launch would run
    one process; else None. ``options`` maps each torchrun option to whether it takes a value."""
    moved: list[str] = []
    kept: list[str] = []
    position = 0
    while position < len(recipe_args):
        arg = recipe_args[position]
        option = arg.split("=")[0]
        if option not in options or arg == "--config":
            kept.append(arg)
        elif options[option] and "=" not in arg and position + 1 < len(recipe_args):
            moved += [arg, recipe_args[position + 1]]
            position += 1
        else:
            moved.append(arg)
        position += 1
    if not moved:
        return None
    typed = _typed_command()
    before = typed[2 : typed.index(recipe)] if recipe in typed[2:] else []
    command = shlex.join(["tune", "run", *before, *moved, recipe, *kept])
    return (
        f"{shlex.join(moved)}: a torchrun option after the recipe, where tune run hands it to "
        f"the recipe (and starts one process). Give it before the recipe: {command}"
    )


def several_nodes_without_rendezvous(nnodes: str, rdzv_endpoint: str) -> str | None:
    """The message refusing ``--nnodes`` above 1 (``2``, or a range ``1:4``) without
    ``--rdzv_endpoint``, else None: ``tune run`` would start each node standalone (see
    [launch mix-ups])."""
    most = nnodes.split(":")[-1]
    if rdzv_endpoint or not most.isdigit() or int(most) <= 1:
        return None
    return (
        f"--nnodes {nnodes} without --rdzv_endpoint: tune run then starts every node on its "
        "own (torchrun's --standalone), and each waits for the others until it times out. "
        "Give every node the same --rdzv_backend c10d --rdzv_endpoint <first node>:<port> "
        '--rdzv_id <job id> (docs/meshes.md, "Several nodes").'
    )


def _typed_command() -> list[str]:
    return ["tune", *sys.argv[1:]]


def _stock_recipe_with_exactga_config(recipe: str, config_file: str | None) -> str | None:
    """Where ``recipe`` is torchtune's and exactga has a recipe of that name, the message
    refusing a config that carries exactga's keys; else None."""
    if recipe_entry(recipe) is None or config_file is None:
        return None
    keys = sorted(EXACTGA_ONLY_KEYS & _top_level_keys(config_file))
    if not keys:
        return None
    shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    command = _with_recipe(_typed_command(), recipe, PREFIX + recipe) or shlex.join(
        ["tune", "run", PREFIX + recipe, "--config", config_file]
    )
    owner = recipe_of_config(config_file)
    written_for = (
        f" (this config is written for {PREFIX}{owner})" if owner not in (None, recipe) else ""
    )
    return (
        f"'{recipe}' is torchtune's own recipe, which does not read this config's exactga keys "
        f"({shown}) and would train without them, without a word. Run exactga's recipe: "
        f"{command} (or {_recipe_file(recipe)} in exactga's folder){written_for}. For torchtune's "
        "own, give it a config without exactga's keys."
    )


def _top_level_keys(config_file: str) -> set[str]:
    """The config file's top-level keys, or none where it cannot be read (the recipe then
    names the problem itself)."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(config_file).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return set()
    return {str(key) for key in loaded} if isinstance(loaded, dict) else set()


def _importable(recipe: str) -> bool:
    """Whether torchtune's module form of an unlisted recipe argument (``a/b.py`` ->
    ``a.b``) finds a module, as its runpy or torchrun's ``python -m`` would."""
    dotted = os.path.splitext(recipe)[0].replace("/", ".")
    if not all(part.isidentifier() for part in dotted.split(".")):
        return False
    # torchtune appends the working directory to sys.path before it imports the recipe
    added = os.getcwd() not in sys.path
    if added:
        sys.path.append(os.getcwd())
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _no_such_recipe(recipe: str, listed: Mapping[str, bool]) -> str:
    stem = Path(recipe).stem
    candidates = list(listed)
    # A file's name (the names of a file that serves two: recipes/full_finetune.py).
    nearest = [PREFIX + e.name for e in RECIPES if stem in (e.name, e.recipe_file)]
    if not nearest:
        nearest = difflib.get_close_matches(recipe, candidates, n=1, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(n) for n in nearest[:2])}?" if nearest else ""
    return (
        f"tune run {recipe}: no such recipe: not a name 'tune ls' lists, nor a file or module "
        f"found from the working directory {Path.cwd()}.{hint} exactga's recipes run from any "
        f"folder by name ({PREFIX}<recipe>)."
    )
