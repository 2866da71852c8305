"""PPO through ``tune run``: the step does not depend on how a PPO batch is split, a run
killed with SIGKILL resumes bit-identically, and stock's config is known to the recipe.

One trajectory step of 8 prompts (responses of 1 to 8 tokens: a fifth of the vocabulary stops
them), ``ppo_epochs`` 2 over PPO batches of 4: four optimizer steps on the same trajectories.
Under SGD (Adam would blow fp32 rounding of near-zero gradient entries up to its step size) the
policy's and the value model's weights after GA 4, GA 2 by length and a token budget land
within a relative L2 of 1e-5 of GA 1's, and stock's per-micro-batch means (``naive``) are off
by far more; the in-process oracle is tests/test_ppo.py. A run with a step checkpoint after
every trajectory step is killed at a random one and resumed: its weights equal the
uninterrupted run's exactly and it logs the same losses for the steps after its checkpoint.
``EXACTGA_KILL_SEED`` replays a kill point.

Validation (issue #64; exactga.ppo.validation) rides on these runs, no launch added: GA 1 and GA
4 validate at the epoch's end on the first 6 prompts, in one batch of 6 and in batches of 1, with
the same figures; the uninterrupted run validates after every trajectory step, and the resumed
run, which does not, still ends on its weights and losses exactly, so validating changes no
training step.

``keep_best_checkpoint`` (docs/validation.md, "The best checkpoint"), among the same runs: a run
of four epochs of one trajectory step (8 training prompts, the held-out set the same 8)
validates at each epoch's end; its last two figures tie, and ``best/`` and ``value/best/`` must
hold the policy's and the value model's epoch folders of the first highest ``val/reward_mean``.
The same run stopped after step 12 (a SIGTERM it sends itself, tests/run_hooks.py) and resumed
keeps that best, where a resume that forgot it would take the tie's later step.

Launches: the killed one; every other run one after another, each forked from the tests' server
(tests/many_runs.py), the GA parity report on
the same step's config included. The adapted stock config
(``mistral/7B_full_ppo_low_memory``: batch 128, ``compile``, bf16, minutes on CPU) is validated
in process, and trained in that launch only with ``EXACTGA_PPO_STOCK_CONFIG=1``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import traceback
from pathlib import Path

import pytest
import stock_configs
from many_runs import Run, launch_runs
from omegaconf import OmegaConf
from recipe_utils import (
    REPO_ROOT,
    latest_step_checkpoint,
    launch_and_kill,
    load_weights,
    logged_steps,
    relative_l2,
)
from run_hooks import NO_FIGURE, STOP_AFTER_STEP

from exactga.checkpoints.contents import BEST_RECORD
from exactga.config.validation import validate_config
from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ppo")]

RECIPE = "recipes/ppo_full_finetune_single_device.py"
CONFIG = str(REPO_ROOT / "configs" / "tiny" / "ppo_single_device.yaml")
FLOOR = 1e-5  # the bound, fp32
STOP = "[" + ",".join(map(str, range(3, 2048, 5))) + "]"  # every fifth id stops a response
STEP = {
    "batch_size": 8,
    "num_steps": 8,
    "ppo_batch_size": 4,
    "ppo_epochs": 2,
    "forward_batch_size": 4,
    "stop_token_ids": STOP,
}
SGD = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
}
SPLITS = {
    "ga1": {"gradient_accumulation_steps": 1},
    "ga4": {"gradient_accumulation_steps": 4, "micro_batching": "fixed"},
    "ga2_by_length": {"gradient_accumulation_steps": 2, "micro_batching": "by_length"},
    "token_budget": {"micro_batching": "token_budget", "micro_batch_tokens": 40},
    "naive_ga4": {
        "gradient_accumulation_steps": 4,
        "micro_batching": "fixed",
        "loss_normalization": "naive",
    },
}
HELD_OUT = 6  # validation's prompts: the first 6 of the training set
VALIDATION = {"dataset_val": "${dataset}"}
VALIDATED = {  # split -> how its validation batches the held-out prompts
    "ga1": {**VALIDATION, "batch_size_val": HELD_OUT, "max_val_batches": 1},
    "ga4": {**VALIDATION, "batch_size_val": 1, "max_val_batches": HELD_OUT},
}
TRAJECTORY_STEPS = 3  # killed after 1 or 2, resumed for the rest
STEPS_PER_TRAJECTORY = 4  # ppo_epochs 2 x batch_size 8 / ppo_batch_size 4
RESUMABLE = {**STEP, "num_steps": 8 * TRAJECTORY_STEPS, "save_every_n_steps": 1}
# keep_best_checkpoint: four epochs of one trajectory step (8 prompts), validated at each end.
BEST = {
    **STEP,
    **SGD,
    "num_steps": 32,
    "seed": 1,  # a tie between the last two figures, and the highest not the last
    "dataset.split": "train[:8]",
    "dataset_val": "${dataset}",
    "keep_best_checkpoint": True,
}
BEST_STOP = 12  # the stopped run's last step, before its resume
STOCK = "mistral/7B_full_ppo_low_memory"
TRAIN_STOCK = bool(os.environ.get("EXACTGA_PPO_STOCK_CONFIG"))


def ppo_args(out: Path, **overrides: object) -> list[str]:
    """``tune run`` arguments of the tiny config with ``overrides`` (``~key`` removes one)."""
    args = [RECIPE, "--config", CONFIG, f"output_dir={out}"]
    for key, value in overrides.items():
        args.append(key if value is None else f"{key}={value}")
    return args


def _weights(out: Path) -> tuple[dict, dict]:
    """The policy's and the value model's trained weights (their epoch checkpoints)."""
    file = "epoch_0/model-00001-of-00001.safetensors"
    return load_weights(out / file), load_weights(out / "value" / file)


def _initial(out: Path) -> tuple[dict, dict]:
    return (
        load_weights(out / "base_policy" / "model.safetensors"),
        load_weights(out / "base_reward" / "model.safetensors"),
    )


def _kill_seed() -> int:
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    def make(root: Path) -> None:
        seed = _kill_seed()
        rng = random.Random(seed)
        killed = root / "killed"
        killed.mkdir()
        kill_after = STEPS_PER_TRAJECTORY * rng.randint(1, TRAJECTORY_STEPS - 1)
        try:
            launch_and_kill(
                ppo_args(killed / "run", **RESUMABLE),
                killed / "killed.txt",
                ready=lambda: latest_step_checkpoint(killed / "run") >= kill_after,
                timeout_s=300,
                delay_s=rng.uniform(0.0, 0.2),
            )
            (killed / "draw").write_text(f"EXACTGA_KILL_SEED={seed}")
        except BaseException:  # noqa: BLE001 - the resume test reports it
            (killed / "kill_failed").write_text(traceback.format_exc()[-8000:])
        runs = [
            Run(
                RECIPE,
                ppo_args(root / name, **STEP, **SGD, **o, **VALIDATED.get(name, {}))[1:],
                root / name,
            )
            for name, o in SPLITS.items()
        ]
        uninterrupted = ppo_args(
            root / "uninterrupted",
            **RESUMABLE,
            **VALIDATION,
            run_val_every_n_steps=STEPS_PER_TRAJECTORY,
            batch_size_val=4,
            max_val_batches=2,
        )
        runs.append(Run(RECIPE, uninterrupted[1:], root / "uninterrupted"))
        runs += _best_runs(root)
        if not (killed / "kill_failed").exists():
            (killed / "checkpoint").write_text(str(latest_step_checkpoint(killed / "run")))
            resume = ppo_args(
                killed / "run",
                **RESUMABLE,
                resume_from_checkpoint=True,
                **{"metric_logger.log_dir": root / "resumed_logs"},
            )
            runs.append(Run(RECIPE, resume[1:], killed / "launch"))
        parity = {
            "parity.splits": "[2x2]",
            "parity.modes": "[exact]",
            "parity.micro_batching": "[fixed]",
        }
        out = root / "parity"
        # Its verdict only: the figure is tests/test_recipe_ga_parity.py's (tests/run_hooks.py).
        parity_args = ppo_args(out, **STEP, **SGD, **parity)[1:]
        runs.append(Run("recipes/ga_parity.py", parity_args, out, {NO_FIGURE: "1"}))
        if TRAIN_STOCK:
            out = root / "stock"
            out.mkdir()
            OmegaConf.save(stock_configs.adapted_ppo_config(STOCK, out), out / "config.yaml")
            runs.append(Run(RECIPE, ["--config", str(out / "config.yaml")], out))
        # the resume after the stopped run (a stop exits with the signal's status)
        launch_runs(runs, nproc=0, timeout_per_run=900)

    return run_once("ppo_runs", make)


def _best_runs(root: Path) -> list[Run]:
    """The best run; the same run stopped after ``BEST_STOP``, then resumed (in one folder)."""
    out = root / "best_resumed_run"
    stop = {STOP_AFTER_STEP: str(BEST_STOP)}
    resume = ppo_args(out, **BEST, resume_from_checkpoint=True)
    return [
        Run(RECIPE, ppo_args(root / "best", **BEST)[1:], root / "best"),
        Run(RECIPE, ppo_args(out, **BEST)[1:], root / "best_stopped", stop),
        Run(RECIPE, resume[1:], root / "best_resumed"),
    ]


def _launched(folder: Path) -> tuple[int, str]:
    return int((folder / "returncode").read_text()), (folder / "output.txt").read_text()


def _ok(folder: Path) -> None:
    status, output = _launched(folder)
    assert status == 0, output[-4000:]


@pytest.mark.parametrize("split", ["ga4", "ga2_by_length", "token_budget"])
def test_split_trains_the_full_ppo_batch_step(runs, split: str) -> None:
    _ok(runs / "ga1")
    _ok(runs / split)
    initial = _initial(runs / "ga1")
    for trained, reference, start in zip(
        _weights(runs / split), _weights(runs / "ga1"), initial, strict=True
    ):
        assert relative_l2(trained, reference, start) < FLOOR


def test_stock_weighting_is_off_by_far_more(runs) -> None:
    _ok(runs / "naive_ga4")
    initial = _initial(runs / "ga1")
    gaps = [
        relative_l2(trained, reference, start)
        for trained, reference, start in zip(
            _weights(runs / "naive_ga4"), _weights(runs / "ga1"), initial, strict=True
        )
    ]
    assert min(gaps) > 100 * FLOOR, gaps


def test_responses_vary_in_length_and_the_window_means_are_logged(runs) -> None:
    lengths = logged_steps(runs / "ga1" / "logs", "response_lengths")
    assert list(lengths) == [1, 2, 3, 4]
    assert 0 < lengths[1] < 7  # stock's seq_lens: the last response token's index
    for name in ("policy_loss", "value_loss", "ratios", "clipfrac", "approx_policy_kl", "kl"):
        split = logged_steps(runs / "ga4" / "logs", name)
        assert split == pytest.approx(
            logged_steps(runs / "ga1" / "logs", name), rel=1e-4, abs=1e-6
        ), name


def test_killed_ppo_run_resumes_to_the_uninterrupted_weights(runs) -> None:
    killed = runs / "killed"
    if (killed / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(killed / 'kill_failed').read_text()}")
    print((killed / "draw").read_text())
    _ok(runs / "uninterrupted")
    checkpoint = int((killed / "checkpoint").read_text())
    assert checkpoint % STEPS_PER_TRAJECTORY == 0, "a step checkpoint inside a trajectory step"
    status, output = _launched(killed / "launch")
    assert status == 0, output[-4000:]
    assert "Resuming from step checkpoint" in output
    for resumed, reference in zip(
        _weights(killed / "run"), _weights(runs / "uninterrupted"), strict=True
    ):
        for name, weight in reference.items():
            assert resumed[name].equal(weight), f"{name} (killed after step {checkpoint})"
    full, after = logged_steps(runs / "uninterrupted" / "logs"), logged_steps(runs / "resumed_logs")
    total = TRAJECTORY_STEPS * STEPS_PER_TRAJECTORY
    assert list(full) == list(range(1, total + 1))
    assert list(after) == list(range(checkpoint + 1, total + 1))
    for step, loss in after.items():
        assert loss == full[step], step


def test_validation_is_the_same_for_any_batch_size_val(runs) -> None:
    """val/reward_mean and val/value_loss at the epoch's end (step 4) over the same 6 held-out
    prompts, in one batch on GA 1 and in batches of 1 on GA 4 (weights within 1e-5)."""
    figures = {}
    for split in VALIDATED:
        figures[split] = {
            name: logged_steps(runs / split / "logs", name)
            for name in ("val/reward_mean", "val/value_loss")
        }
    print(f"validation at step 4: {figures}")
    one_batch, batches_of_one = figures.values()
    for name, by_step in one_batch.items():
        assert list(by_step) == [STEPS_PER_TRAJECTORY], name
        assert batches_of_one[name] == pytest.approx(by_step, rel=1e-4), name
    validated = logged_steps(runs / "uninterrupted" / "logs", "val/value_loss")
    assert list(validated) == [4, 8, 12]  # after every trajectory step


def test_the_parity_report_takes_a_ppo_config(runs) -> None:
    """recipes/ga_parity.py trains a PPO config with the recipe's own steps (exactga.parity.ppo)."""
    _ok(runs / "parity")
    report = (runs / "parity" / "parity" / "report.md").read_text()
    assert "**Verdict:** EXACT" in report, report[:2000]


def test_the_stock_config_is_known_to_the_recipe(tmp_path, runs) -> None:
    """Stock's config, adapted to tiny shapes, passes the recipe's strict start-up check; with
    ``EXACTGA_PPO_STOCK_CONFIG=1`` it trains among the module's runs, and saves both models."""
    cfg = stock_configs.adapted_ppo_config(STOCK, tmp_path)
    validate_config(cfg, PpoFullFinetuneSingleDeviceConfig, "ppo_full_finetune_single_device")
    if TRAIN_STOCK:
        _ok(runs / "stock")
        assert all(w for w in _weights(runs / "stock"))


def _best(out: Path) -> tuple[dict, dict, dict]:
    """The record of ``out``'s ``best/``, the policy's weights in it and the value model's in
    ``value/best/``."""
    file = "model-00001-of-00001.safetensors"
    best = out / "best"
    return (
        json.loads((best / BEST_RECORD).read_text()),
        load_weights(best / file),
        load_weights(out / "value" / "best" / file),
    )


def _equal(one: dict, other: dict) -> bool:
    return one.keys() == other.keys() and all(one[name].equal(other[name]) for name in one)


def test_the_best_checkpoint_holds_the_first_highest_reward(runs) -> None:
    """``best/`` and ``value/best/`` are the policy's and the value model's epoch folders of the
    first highest val/reward_mean (each epoch one trajectory step of 4 optimizer steps), bit for
    bit; the later step of the same figure is not the best (its value model differs; its
    policy, which no longer changes there, does not); one line per new best."""
    _ok(runs / "best")
    series = logged_steps(runs / "best" / "logs", "val/reward_mean")
    print(f"val/reward_mean per step: {series}")
    assert list(series) == [4, 8, 12, 16]
    best_step = max(series, key=series.__getitem__)  # the first of the highest
    later_ties = [step for step in series if step > best_step and series[step] == series[best_step]]
    assert later_ties and series[best_step] > min(series.values()), "pick another seed"
    record, policy, value = _best(runs / "best")
    epoch = best_step // STEPS_PER_TRAJECTORY - 1
    assert (record["step"], record["epoch"]) == (best_step, epoch)
    assert record["val/reward_mean"] == pytest.approx(series[best_step], rel=1e-6)
    file = "model-00001-of-00001.safetensors"
    for other in range(4):  # the policy stops changing in the tie (its responses all alike)
        saved_policy = load_weights(runs / "best" / f"epoch_{other}" / file)
        saved_value = load_weights(runs / "best" / "value" / f"epoch_{other}" / file)
        same = _equal(policy, saved_policy) and _equal(value, saved_value)
        assert same == (other == epoch), other
    improvements, highest = 0, -math.inf
    for figure in series.values():  # in step order
        if figure > highest:
            improvements, highest = improvements + 1, figure
    output = _launched(runs / "best")[1]
    assert output.count("exactga: best val/reward_mean") == improvements, output[-4000:]


def test_a_resumed_run_keeps_the_uninterrupted_best(runs) -> None:
    """Stopped after step 12 (the best, in the uninterrupted run) and resumed, the run validates
    step 16, a tie: it prints no new best and ends with the uninterrupted run's best, bit for
    bit (one device). A resume that forgot the best its checkpoint recorded would take step 16."""
    status, stopped = _launched(runs / "best_stopped")
    assert status != 0 and f"stopped by SIGTERM after step {BEST_STOP}" in stopped, stopped[-4000:]
    status, output = _launched(runs / "best_resumed")
    assert status == 0, output[-4000:]
    assert "Resuming from step checkpoint" in output
    series = logged_steps(runs / "best" / "logs", "val/reward_mean")
    assert max(series, key=series.__getitem__) == BEST_STOP, "pick another seed"
    assert "exactga: best" not in output
    (record, *weights), (resumed, *resumed_weights) = (
        _best(runs / "best"),
        _best(runs / "best_resumed_run"),
    )
    print(f"uninterrupted {record}, resumed {resumed}")
    assert resumed == record
    assert all(_equal(r, w) for r, w in zip(resumed_weights, weights, strict=True))
