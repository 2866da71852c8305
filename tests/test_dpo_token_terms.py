"""DPO losses with token-level terms: RPO's NLL over the chosen tokens, length-normalised log-probs.

RPO's loss is ``(1/P) sum_p l_p + alpha * (1/T) sum_t -log p(t)``: the DPO loss over the window's
``P`` pairs plus ``alpha`` times the NLL over its ``T`` chosen response tokens (after the shift),
two denominators. The oracle is written here in plain PyTorch, fp64, knowing nothing of exactga,
as in tests/test_preference.py (whose pairs, splits and rank groups it reuses): every sequence
forwarded on its own, its response log-probs summed, its response tokens counted; the window's
loss from those. SGD without momentum makes the step ``w - lr * g``, so the trained weights
compare with it directly. The pairs' chosen responses run from 1 to 30 tokens, so every split
of them puts different numbers of chosen tokens in its micro-batches.

The real path is the recipes' one: ``DpoTerms(...).units()`` through ``LossNormalizer``,
``train_window`` with ``dpo_micro_batch_loss(terms=...)`` and ``Window.scale``, on one process and
on 2 gloo ranks under FSDP2 (5 and 3 pairs, one filler). And one ``tune run`` check on the tiny LoRA
DPO config. See [loss terms over their own units] in exactga.accumulation.loss_units, [chosen
tokens as the NLL's units] and [length-normalised log-probs are per pair] in exactga.dpo.preference.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dpo_utils import (
    LORA_OPTIMIZER,
    LORA_SINGLE,
    LORA_SPLITS,
    dpo_args,
    initial_adapters,
    trained_adapters,
)
from many_runs import launch_runs, run_of
from omegaconf import OmegaConf
from oracle_utils import flat, fp64, lr_for_unit_update, step_gap, trainable
from recipe_utils import REPO_ROOT, read_scalars, relative_l2
from test_preference import (
    BETA,
    PACKED_ROW,
    PAIRS,
    RANK_GROUPS,
    SIDES,
    SPLITS,
    oracle_log_probs,
    packed_rows,
)
from torch import nn
from torchtune.rlhf.loss import DPOLoss
from torchtune.training import shard_model
from unit_utils import run_on_ranks, tiny_lora, tiny_model

from exactga.accumulation import normalization
from exactga.accumulation import step as training
from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.accumulation.normalization import LossNormalizer, NormMode
from exactga.config.options import SequenceLogProb
from exactga.config.validation import validate_config
from exactga.data.micro_batching import SampleWindow
from exactga.data.packing import pack_pairs
from exactga.dpo.log_probs import frozen_model_reference, lora_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import PairsAndChosenTokens, PreferencePairs, collate_pairs
from exactga.dpo.schema import LoraDpoSingleDeviceConfig
from exactga.dpo.terms import DPO, DpoTerms
from exactga.model_build.frozen import freeze_model
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.runtime.distributed import GradientSync, gradient_sync

CPU = torch.device("cpu")
ALPHA = 0.5
RPO = DpoTerms(rpo_alpha=ALPHA, sequence_log_prob=SequenceLogProb.SUM)
MEAN = DpoTerms(rpo_alpha=0.0, sequence_log_prob=SequenceLogProb.MEAN)
MEAN_RPO = DpoTerms(rpo_alpha=ALPHA, sequence_log_prob=SequenceLogProb.MEAN)
TERMS = {"rpo": RPO, "mean": MEAN, "mean_rpo": MEAN_RPO}
# Relative L2 of the trained weights from the oracle step (an update as large as the weights),
# as in tests/test_preference.py. Measured with RPO: fp32 2.8e-7 (full) and 6.3e-7 to 6.6e-7
# (LoRA) over every split, the same on 2 ranks; with length-normalised log-probs 1.6e-7 to
# 3.2e-7; fp64 3.8e-16 to 7.9e-16 (summation order only). A per-micro-batch token mean of the
# NLL (TRL's) is 0.16 to 0.31 off.
ORACLE_BOUND = 2e-6
FP64_BOUND = 1e-12
BOUNDS = {torch.float32: ORACLE_BOUND, torch.float64: FP64_BOUND}
METRIC_TOLERANCE = {torch.float32: {"rel": 1e-5, "abs": 1e-6}, torch.float64: {"rel": 1e-12}}


# --- the oracle: plain PyTorch, fp64, every sequence on its own --------------------------------


def response_lengths(pairs: list[dict]) -> torch.Tensor:
    """(num_pairs, 2): each response's labels after the shift, the tokens its log-prob sums."""
    return torch.tensor(
        [[sum(x != IGNORE_INDEX for x in p[f"{s}_labels"][1:]) for s in SIDES] for p in pairs],
        dtype=torch.float64,
    )


LENGTHS = response_lengths(PAIRS)


def oracle_terms(
    policy: torch.Tensor, reference: torch.Tensor, terms: DpoTerms
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's DPO loss, a mean over its pairs, and its NLL, a mean over its chosen
    tokens, from each response's summed log-probs ``(num_pairs, 2)``."""
    if terms.sequence_log_prob is SequenceLogProb.MEAN:
        policy_seq, reference_seq = policy / LENGTHS, reference / LENGTHS
    else:
        policy_seq, reference_seq = policy, reference
    margins = (policy_seq[:, 0] - policy_seq[:, 1]) - (reference_seq[:, 0] - reference_seq[:, 1])
    dpo = -F.logsigmoid(BETA * margins).mean()
    nll = -policy[:, 0].sum() / LENGTHS[:, 0].sum()
    return dpo, nll


class Case:
    """A policy, its reference and the oracle's loss, gradient and metrics for ``terms``."""

    def __init__(self, kind: str, terms: DpoTerms, dtype: torch.dtype = torch.float32) -> None:
        self.kind, self.terms, self.dtype = kind, terms, dtype
        self.loss_fn = DPOLoss(beta=BETA)
        if kind == "lora":
            self.model = tiny_lora()
            self.ref_model = None
            oracle_reference = tiny_model(seed=None)  # the base weights, alone
            state = self.model.state_dict()
            oracle_reference.load_state_dict({k: v for k, v in state.items() if "lora_" not in k})
        else:
            self.model = tiny_model()
            self.ref_model = freeze_model(tiny_model(seed=7))
            oracle_reference = self.ref_model
        self.initial = flat(trainable(self.model))
        policy64 = copy.deepcopy(self.model).double()
        with fp64():
            with torch.no_grad():
                ref_log_probs = oracle_log_probs(copy.deepcopy(oracle_reference).double(), PAIRS)
            dpo, nll = oracle_terms(oracle_log_probs(policy64, PAIRS), ref_log_probs, terms)
            loss = dpo + terms.rpo_alpha * nll
            loss.backward()
        self.oracle = {
            name: float(value.detach())
            for name, value in (("loss", loss), ("dpo_loss", dpo), ("chosen_nll", nll))
        }
        self.gradient = flat([p.grad for p in trainable(policy64)])
        self.lr = lr_for_unit_update(self.initial, self.gradient)
        for model in (self.model, self.ref_model):
            if model is not None:
                model.to(dtype)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        return fp64() if self.dtype == torch.float64 else contextlib.nullcontext()

    def reference(self):
        if self.ref_model is None:
            return lora_reference(self.model)
        return frozen_model_reference(self.ref_model)

    def gap(self) -> float:
        trained = flat([_full(p) for p in trainable(self.model)])
        return step_gap(trained, self.initial, self.gradient, self.lr)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


# --- the real step ----------------------------------------------------------------------------


def real_step(
    case: Case,
    groups: list[list[int]],
    mode: NormMode = NormMode.EXACT,
    by_budget: bool = False,
    pair_weighted_nll: bool = False,
    packed: bool = False,
) -> dict:
    """One SGD step of ``case.model`` over the pairs in ``groups`` (this rank's micro-batches),
    as a DPO recipe takes it: the window's logged loss, metrics and filler count.

    ``pair_weighted_nll``: the NLL's per-micro-batch token mean added to the DPO mean and the
    sum weighted by the micro-batch's pairs (exact pair weighting, no token units): a baseline.
    ``packed``: each micro-batch one packed row (``micro_batching: packed``).
    """
    group = dist.group.WORLD if dist.is_initialized() else None
    collate = functools.partial(pack_pairs, capacity=PACKED_ROW) if packed else collate_pairs
    micro_batches = [collate([PAIRS[i] for i in g]) for g in groups]
    sample_window = SampleWindow(micro_batches, sum(map(len, groups)), 0, 0, False, by_budget)
    metrics = PreferenceMetrics(terms=None if pair_weighted_nll else case.terms)
    units = PreferencePairs() if pair_weighted_nll else case.terms.units()
    normalizer = LossNormalizer(case.loss_fn, mode=mode, dp_group=group, units=units)
    num_reduces = []
    with _counting_all_reduces(num_reduces):
        (window,) = metrics.track(normalizer.windows([sample_window]))
    loss_step = functools.partial(
        dpo_micro_batch_loss,
        case.model,
        case.loss_fn,
        reference=case.reference(),
        terms=case.terms,
        metrics=metrics,
    )
    if pair_weighted_nll:
        loss_step = _summed(loss_step)
    settings = ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0)
    with case.precision():
        training.train_window(
            window,
            model=case.model,
            loss_step=loss_step,
            optimizer=torch.optim.SGD(trainable(case.model), lr=case.lr),
            profiler=TrainingProfiler(settings, CPU, case.model),
            device=CPU,
            step=1,
            micro_batch_context=functools.partial(
                gradient_sync, case.model, GradientSync.ONCE_PER_WINDOW
            ),
        )
    return {
        "loss": window.global_mean_loss(),
        "local_loss": window.local_mean_loss(),
        "metrics": metrics.window_metrics(window),
        "fillers": window.num_filler_micro_batches(),
        "opening_reduces": num_reduces,
        "term_units": list(window.num_global_term_units),
    }


def _summed(loss_step):
    return lambda batch: loss_step(batch).total


@contextlib.contextmanager
def _counting_all_reduces(shapes: list):
    """Record the shape of every all-reduce the normaliser issues meanwhile."""
    all_reduce = normalization.dist.all_reduce

    def counting(tensor, *args, **kwargs):
        shapes.append(list(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    normalization.dist.all_reduce = counting
    try:
        yield
    finally:
        normalization.dist.all_reduce = all_reduce


@functools.cache
def one_process(kind: str, terms: str, split: str, dtype: torch.dtype) -> tuple[float, dict, dict]:
    case = Case(kind, TERMS[terms], dtype)
    if split == "packed":
        result = real_step(case, packed_rows(range(len(PAIRS))), packed=True)
    else:
        result = real_step(case, SPLITS[split])
    return case.gap(), result, case.oracle


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and does not fight a suite run beside it."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64], ids=lambda d: str(d).removeprefix("torch.")
)


# --- (a) one process: RPO over every split -----------------------------------------------------


@DTYPES
@pytest.mark.parametrize("split", [*SPLITS, "packed"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_rpo_step_is_the_full_batch_step(kind: str, split: str, dtype: torch.dtype) -> None:
    gap, result, oracle = one_process(kind, "rpo", split, dtype)
    print(f"rpo {kind} {split} {dtype}: relative L2 to the oracle step {gap:.2e}")
    assert gap <= BOUNDS[dtype]
    tolerance = METRIC_TOLERANCE[dtype]
    assert result["loss"] == result["local_loss"] == pytest.approx(oracle["loss"], **tolerance)
    metrics = result["metrics"]
    assert metrics["dpo_loss"] == pytest.approx(oracle["dpo_loss"], **tolerance)
    assert metrics["chosen_nll"] == pytest.approx(oracle["chosen_nll"], **tolerance)
    assert result["term_units"] == [len(PAIRS), int(LENGTHS[:, 0].sum())]
    assert result["opening_reduces"] == []  # one process: no collective


@pytest.mark.parametrize("split", [*SPLITS, "packed"])
@pytest.mark.parametrize("terms", ["mean", "mean_rpo"])
def test_length_normalised_log_probs_need_no_count_of_their_own(terms: str, split: str) -> None:
    """Each response's mean log-prob is its own, so the pairs stay the units: alone it adds no
    count, with RPO the chosen tokens are the NLL's (see [length-normalised log-probs are per
    pair])."""
    gap, result, oracle = one_process("full", terms, split, torch.float32)
    print(f"{terms} full {split}: relative L2 to the oracle step {gap:.2e}")
    assert gap <= ORACLE_BOUND
    assert result["loss"] == pytest.approx(oracle["loss"], rel=1e-5)
    assert type(TERMS[terms].units()) is (
        PairsAndChosenTokens if "rpo" in terms else PreferencePairs
    )


def test_length_normalised_and_summed_log_probs_are_different_losses() -> None:
    """So the split test above can fail: the mean's oracle is not the sum's."""
    summed, mean = Case("full", RPO), Case("full", MEAN_RPO)
    assert float((summed.gradient - mean.gradient).norm() / summed.gradient.norm()) > 0.1


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_per_micro_batch_token_mean_is_far_off(kind: str) -> None:
    """TRL's NLL, a token mean per micro-batch: on 2x4 every micro-batch holds 2 pairs (so stock's
    1/ga weighting of the DPO term is right there) but 14, 37, 7 and 14 chosen tokens; on the
    3-1-4 regrouping weighted by pairs, as exact as pairs go, it is still wrong."""
    gaps = {}
    for split, mode, pair_weighted in (
        ("2x4", NormMode.NAIVE, False),
        ("3-1-4", NormMode.EXACT, True),
    ):
        case = Case(kind, RPO)
        real_step(case, SPLITS[split], mode=mode, pair_weighted_nll=pair_weighted)
        gaps[split] = case.gap()
    print(f"rpo {kind}: per-micro-batch token mean {gaps}")
    assert min(gaps.values()) > 100 * ORACLE_BOUND
    # The DPO term alone is exact under naive weighting on 2x4: the gap is the NLL's.
    dpo_only = Case(kind, DPO)
    real_step(dpo_only, SPLITS["2x4"], mode=NormMode.NAIVE)
    assert dpo_only.gap() <= ORACLE_BOUND


def test_rpo_alpha_zero_is_stock_dpo_by_the_same_code() -> None:
    """``rpo_alpha: 0`` (the default) declares no further unit and returns the scalar mean, so
    the normaliser, the window and the step take exactly the path they took before the knob."""
    assert DpoTerms(rpo_alpha=0.0, sequence_log_prob=SequenceLogProb.SUM) == DPO
    assert type(DPO.units()) is PreferencePairs
    assert not hasattr(DPO.units(), "term_names")
    assert PreferenceMetrics(terms=DPO).names == PreferenceMetrics.NAMES
    case = Case("full", DPO)
    batch = PreferencePairs().prepare(collate_pairs(PAIRS[:3]), 3, runs_empty=False)
    reference = case.reference()
    with_terms = dpo_micro_batch_loss(case.model, case.loss_fn, dict(batch), reference, terms=DPO)
    without = dpo_micro_batch_loss(case.model, case.loss_fn, dict(batch), reference)
    assert not with_terms.terms and torch.equal(with_terms.main, without.main)


# --- (b) two ranks under FSDP2, unequal pairs and chosen tokens, one emptied filler ------------


def _two_rank_worker(rank: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for kind in ("full", "lora"):
        case = Case(kind, RPO)
        for model in (case.model, case.ref_model):
            if model is not None:
                shard_model(model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
        result = real_step(case, RANK_GROUPS[rank], by_budget=True)
        results[kind] = {**result, "gap": case.gap(), "oracle": case.oracle}
    return results


def _is_layer(name: str, module: nn.Module) -> bool:
    return name.startswith("layers.") and name.count(".") == 1


def test_two_ranks_with_unequal_pairs_and_a_filler_take_the_full_batch_rpo_step(tmp_path) -> None:
    results = run_on_ranks(_two_rank_worker, (), tmp_path)
    for kind in ("full", "lora"):
        on_rank = [r[kind] for r in results]
        assert [r["fillers"] for r in on_rank] == [0, 1]
        # The window's one collective carries the chosen tokens as a fourth column.
        assert [r["opening_reduces"] for r in on_rank] == [[[2, 4]], [[2, 4]]]
        assert on_rank[0]["term_units"] == [len(PAIRS), int(LENGTHS[:, 0].sum())]
        assert on_rank[0]["gap"] == on_rank[1]["gap"]  # the same full weights on both ranks
        assert on_rank[0]["metrics"] == on_rank[1]["metrics"]
        assert on_rank[0]["loss"] == on_rank[1]["loss"]
        print(f"rpo {kind} 2 ranks (5 + 3 pairs, one filler): {on_rank[0]['gap']:.2e}")
        assert on_rank[0]["gap"] <= ORACLE_BOUND
        oracle, tolerance = on_rank[0]["oracle"], METRIC_TOLERANCE[torch.float32]
        assert on_rank[0]["loss"] == pytest.approx(oracle["loss"], **tolerance)
        for name in ("dpo_loss", "chosen_nll"):
            assert on_rank[0]["metrics"][name] == pytest.approx(oracle[name], **tolerance)


# --- (c) units and bad settings ------------------------------------------------------------------


def test_chosen_tokens_are_counted_after_the_shift_and_none_in_an_emptied_batch() -> None:
    pairs = [  # the chosen response's first label sits at position 0: not scored
        {
            "chosen_input_ids": [5, 6, 7],
            "chosen_labels": [5, 6, 7],
            "rejected_input_ids": [5, 9],
            "rejected_labels": [IGNORE_INDEX, 9],
        },
        PAIRS[0],
    ]
    units, batch = PairsAndChosenTokens(), collate_pairs(pairs)
    assert units.count(batch) == 2
    assert units.count_terms(batch) == (2 + int(LENGTHS[0, 0]),)
    assert units.count_terms(units.emptied(batch)) == (0,)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rpo_alpha": -0.5}, "config key 'rpo_alpha' must be at least 0"),
        ({"rpo_alpha": float("nan")}, "config key 'rpo_alpha'"),
        (
            {"sequence_log_prob": "avg"},
            "config key 'sequence_log_prob'='avg': choose one of sum, mean",
        ),
    ],
)
def test_bad_term_settings_are_named(overrides: dict, message: str) -> None:
    cfg = OmegaConf.load(REPO_ROOT / LORA_SINGLE[1])
    cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    with pytest.raises(ValueError, match=message):
        validate_config(cfg, LoraDpoSingleDeviceConfig, "lora_dpo_single_device")


def test_the_library_refuses_a_negative_weight_too() -> None:
    with pytest.raises(ValueError, match="rpo_alpha must be at least 0"):
        DpoTerms(rpo_alpha=-1.0, sequence_log_prob=SequenceLogProb.SUM)
    with pytest.raises(ValueError, match="'sequence_log_prob'"):
        DpoTerms(rpo_alpha=0.0, sequence_log_prob="avg")  # type: ignore[arg-type]


# --- (d) through tune run: LoRA DPO with RPO, 1x8 against 2x4 ------------------------------------

# rpo_alpha 0.5 as 1x8 and 2x4, and as 2x4 under stock's weighting (the NLL's token mean per
# micro-batch, as TRL takes it); rpo_alpha 0 written out, and the keys left out (the tiny
# config shows them only as comments), so the schema's defaults apply. One epoch each: its three
# steps (two windows of 8 pairs, a partial one of 4) are what the splits must agree on.
RPO_RUNS = {
    "rpo_1x8": {**LORA_SPLITS["1x8"], "rpo_alpha": 0.5},
    "rpo_2x4": {**LORA_SPLITS["2x4"], "rpo_alpha": 0.5},
    "rpo_2x4_naive": {
        **LORA_SPLITS["2x4"],
        "rpo_alpha": 0.5,
        "loss_normalization": "naive",
        "micro_batching": "fixed",  # naive's micro-batches are stock's
    },
    "alpha0_1x8": {**LORA_SPLITS["1x8"], "rpo_alpha": 0.0},
    "default_1x8": LORA_SPLITS["1x8"],
}
FLOOR = 2e-6  # fp32: the bound for every split, as tests/test_recipe_dpo_lora.py


def _make_rpo_runs(root: Path) -> None:
    runs = []
    for name, overrides in RPO_RUNS.items():
        out = root / name
        args = dpo_args(LORA_SINGLE, out, epochs=1, **LORA_OPTIMIZER, **overrides)
        nproc, run = run_of(args, out)
        assert nproc == 0
        runs.append(run)
    launch_runs(runs, nproc=0)  # the runs one after another, each forked


@pytest.fixture(scope="module")
def rpo_runs(run_once) -> dict[str, Path]:
    root = run_once("dpo_rpo_runs", _make_rpo_runs)
    for name in RPO_RUNS:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", output[-4000:]
    return {name: root / name for name in RPO_RUNS}


@pytest.mark.slow
def test_rpo_through_tune_run_trains_the_same_adapters_for_1x8_and_2x4(rpo_runs) -> None:
    initial = initial_adapters()
    reference = trained_adapters(rpo_runs["rpo_1x8"], 0)
    gap = relative_l2(trained_adapters(rpo_runs["rpo_2x4"], 0), reference, initial)
    print(f"rpo_alpha 0.5, 2x4 vs 1x8 after the epoch's 3 steps: relative L2 {gap:.2e}")
    assert gap <= FLOOR
    # The NLL's token mean per micro-batch, and leaving the term out, train something else,
    # far beyond the bound: the check above can fail.
    for other in ("rpo_2x4_naive", "default_1x8"):
        gap = relative_l2(trained_adapters(rpo_runs[other], 0), reference, initial)
        print(f"{other} vs rpo_alpha 0.5 1x8 after the epoch: relative L2 {gap:.2e}")
        assert gap > 1e3 * FLOOR
    scalars = {name: read_scalars(rpo_runs[name] / "logs") for name in ("rpo_1x8", "rpo_2x4")}
    for name in ("loss", "dpo_loss", "chosen_nll"):
        assert scalars["rpo_2x4"][name] == pytest.approx(scalars["rpo_1x8"][name], rel=1e-5), name
    logged = scalars["rpo_1x8"]
    expected = [d + 0.5 * n for d, n in zip(logged["dpo_loss"], logged["chosen_nll"], strict=True)]
    assert logged["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_rpo_alpha_zero_is_bit_identical_to_leaving_the_key_out(rpo_runs) -> None:
    written, default = (trained_adapters(rpo_runs[n], 0) for n in ("alpha0_1x8", "default_1x8"))
    assert written.keys() == default.keys()
    assert all(torch.equal(written[k], default[k]) for k in written)
    written, default = (read_scalars(rpo_runs[n] / "logs") for n in ("alpha0_1x8", "default_1x8"))
    assert written["loss"] == default["loss"]
    assert "chosen_nll" not in written and "dpo_loss" not in written
