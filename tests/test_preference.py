"""Exact DPO: one optimizer step over preference pairs against a full-batch oracle.

The oracle is written here in plain PyTorch, fp64, knowing nothing of exactga: every sequence
forwarded on its own (no padding at all), its ``log p(label)`` summed over the positions whose
label after the one-position shift is a response token, the sigmoid DPO loss with ``BETA`` per
pair, the mean over all pairs of the window. Its reference model for LoRA is a plain llama3_2
holding the LoRA model's base weights (not ``disable_adapter``). SGD without momentum makes the
step ``w - lr * g``, so the trained weights compare with it directly, as in tests/test_oracle.py.
The real step runs twice: in fp64 (under the same :func:`fp64` context), where exactness leaves
nothing but summation order, and in fp32, the precision a run trains in.

The real path is the recipes' one: ``collate_pairs``, ``LossNormalizer(units=PreferencePairs())``,
``train_window`` with ``dpo_micro_batch_loss`` (and ``Window.scale``), on one process and on 2 gloo
ranks under FSDP2. See [pairs as loss units] in exactga.dpo.preference.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle_utils import flat, fp64, lr_for_unit_update, step_gap, trainable
from torch import nn
from torchtune.rlhf.loss import DPOLoss, RSOLoss
from torchtune.training import shard_model
from unit_utils import VOCAB, run_on_ranks, tiny_lora, tiny_model

from exactga.accumulation import forward
from exactga.accumulation import step as training
from exactga.accumulation.loss_units import IGNORE_INDEX, LOSS_POSITIONS
from exactga.accumulation.normalization import LossNormalizer, NormMode
from exactga.data.micro_batching import SampleWindow, first_fit_decreasing, sample_positions
from exactga.data.packing import pack_pairs
from exactga.dpo.log_probs import frozen_model_reference, lora_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import EMPTY, PreferencePairs, collate_pairs
from exactga.model_build.frozen import freeze_model
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.runtime.distributed import GradientSync, gradient_sync

CPU = torch.device("cpu")
BETA = 0.1
# Relative L2 of the trained weights from the oracle step, an update as large as the weights.
# fp64: measured 4e-16 to 1.1e-15 over every split and kind (summation order only). fp32:
# measured 5.1e-7 (full) to 9.7e-7 (LoRA), 1 and 2 ranks; the same full-batch loss written in
# fp32 without exactga (fp32 sums of log-probs near -900) is 1.2e-6 / 2.2e-6 off. The mean of
# micro-batch means (stock's weighting) is 1.3 (full) and 0.43 (LoRA) off on the 3-1-4 split.
ORACLE_BOUND = 2e-6
FP64_BOUND = 1e-12
BOUNDS = {torch.float32: ORACLE_BOUND, torch.float64: FP64_BOUND}
# Metrics in fp32: a reward is beta times a difference of log-prob sums near -900, whose fp32
# spacing is 6e-5, so its absolute error is some 1e-6.
METRIC_TOLERANCE = {torch.float32: {"rel": 1e-5, "abs": 1e-5}, torch.float64: {"rel": 1e-12}}

# (prompt, chosen response, rejected response) lengths: chosen and rejected differ in every
# pair; sequences of 3 to 33 tokens, responses of 1 to 30.
SPECS = [
    (5, 12, 3),
    (1, 2, 20),
    (14, 7, 8),
    (3, 30, 9),
    (9, 1, 4),
    (2, 6, 15),
    (20, 10, 2),
    (6, 4, 11),
]
# Micro-batches as pair indices; the last regroups pairs out of order into 3, 1, 4.
SPLITS = {
    "8x1": [list(range(8))],
    "1x8": [[i] for i in range(8)],
    "2x4": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "3-1-4": [[3, 1, 5], [6], [0, 2, 4, 7]],
}
# On two ranks: 5 and 3 pairs, 2 and 1 micro-batches, so rank 1 runs one emptied filler.
RANK_GROUPS = [[[3, 1, 5], [6, 0]], [[2, 4, 7]]]
# Packed rows of the tiny model's max_seq_len: a pair's two sides take 24 to 52 positions, so
# rows hold one or two pairs (split "packed"; on two ranks 4 and 2 rows, so two fillers).
PACKED_ROW = 64


def make_pairs(specs=SPECS, seed: int = 0) -> list[dict[str, list[int]]]:
    """torchtune ``PreferenceDataset`` items: one prompt, two responses, prompt labels masked."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for prompt_len, chosen_len, rejected_len in specs:
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        item = {}
        for side, length in (("chosen", chosen_len), ("rejected", rejected_len)):
            response = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
            item[f"{side}_input_ids"] = prompt + response
            item[f"{side}_labels"] = [IGNORE_INDEX] * prompt_len + response
        pairs.append(item)
    return pairs


PAIRS = make_pairs()


# --- the oracle: plain PyTorch, fp64, every sequence on its own --------------------------------


def oracle_log_prob(model: nn.Module, tokens: list[int], labels: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([tokens]))[0, :-1]
    targets = torch.tensor(labels[1:])
    keep = targets != IGNORE_INDEX
    return torch.log_softmax(logits[keep], dim=-1).gather(1, targets[keep, None]).sum()


def oracle_log_probs(model: nn.Module, pairs: list[dict]) -> torch.Tensor:
    """(num_pairs, 2): each pair's chosen and rejected summed response log-probs."""
    return torch.stack(
        [
            torch.stack(
                [oracle_log_prob(model, p[f"{s}_input_ids"], p[f"{s}_labels"]) for s in SIDES]
            )
            for p in pairs
        ]
    )


SIDES = ("chosen", "rejected")


def oracle_pair_losses(policy: torch.Tensor, reference: torch.Tensor, loss: str) -> torch.Tensor:
    logits = BETA * ((policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1]))
    return -F.logsigmoid(logits) if loss == "dpo" else torch.relu(1 - logits)


class Case:
    """A policy, its reference, and what the oracle computes for them (fp64, at the start)."""

    def __init__(self, kind: str, loss: str = "dpo", dtype: torch.dtype = torch.float32) -> None:
        self.kind, self.loss, self.dtype = kind, loss, dtype
        self.loss_fn = DPOLoss(beta=BETA) if loss == "dpo" else RSOLoss(gamma=BETA)
        if kind == "lora":
            self.model = tiny_lora()
            self.ref_model = None
            base = tiny_model(seed=None)  # the oracle's reference: the base weights, alone
            state = self.model.state_dict()
            base.load_state_dict({k: v for k, v in state.items() if "lora_" not in k})
            oracle_reference = base
        else:
            self.model = tiny_model()
            self.ref_model = freeze_model(tiny_model(seed=7))
            oracle_reference = self.ref_model
        self.initial = flat(trainable(self.model))
        policy64 = copy.deepcopy(self.model).double()
        with fp64():
            with torch.no_grad():
                reference64 = copy.deepcopy(oracle_reference).double()
                self.ref_log_probs = oracle_log_probs(reference64, PAIRS)
            log_probs = oracle_log_probs(policy64, PAIRS)
            loss = oracle_pair_losses(log_probs, self.ref_log_probs, loss).mean()
            loss.backward()
        self.log_probs = log_probs.detach()
        self.oracle_loss = float(loss.detach())
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

    def oracle_metrics(self) -> dict[str, float]:
        chosen = BETA * (self.log_probs[:, 0] - self.ref_log_probs[:, 0])
        rejected = BETA * (self.log_probs[:, 1] - self.ref_log_probs[:, 1])
        return {
            "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()),
            "rewards/accuracies": float((chosen > rejected).double().mean()),
            "rewards/margins": float((chosen - rejected).mean()),
            "log_probs/chosen": float(self.log_probs[:, 0].mean()),
            "log_probs/rejected": float(self.log_probs[:, 1].mean()),
        }

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
    packed: bool = False,
) -> tuple[dict[str, float], int]:
    """One SGD step of ``case.model`` over the pairs in ``groups`` (this rank's micro-batches,
    each a packed row with ``packed``), as a DPO recipe takes it; the window's metrics and this
    rank's filler count."""
    group = dist.group.WORLD if dist.is_initialized() else None
    collate = functools.partial(pack_pairs, capacity=PACKED_ROW) if packed else collate_pairs
    micro_batches = [collate([PAIRS[i] for i in g]) for g in groups]
    sample_window = SampleWindow(micro_batches, sum(map(len, groups)), 0, 0, False, by_budget)
    metrics = PreferenceMetrics()
    normalizer = LossNormalizer(case.loss_fn, mode=mode, dp_group=group, units=PreferencePairs())
    (window,) = metrics.track(normalizer.windows([sample_window]))
    loss_step = functools.partial(
        dpo_micro_batch_loss, case.model, case.loss_fn, reference=case.reference(), metrics=metrics
    )
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
    assert window.global_mean_loss() == pytest.approx(case.oracle_loss, rel=1e-5)
    return metrics.window_metrics(window), window.num_filler_micro_batches()


@functools.cache
def one_process(
    kind: str, split: str, dtype: torch.dtype, loss: str = "dpo"
) -> tuple[float, dict[str, float], dict]:
    case = Case(kind, loss, dtype)
    if split == "packed":
        metrics, _ = real_step(case, packed_rows(range(len(PAIRS))), packed=True)
    else:
        metrics, _ = real_step(case, SPLITS[split])
    return case.gap(), metrics, case.oracle_metrics()


def packed_rows(pairs) -> list[list[int]]:
    """``pairs`` placed first-fit decreasing into rows of ``PACKED_ROW`` positions, as
    ``micro_batching: packed`` places them (both sides of a pair in one row)."""
    pairs = list(pairs)
    rows = first_fit_decreasing([sample_positions(PAIRS[i]) for i in pairs], PACKED_ROW)
    return [[pairs[i] for i in row] for row in rows]


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


# --- (a) one process, every split -------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("split", [*SPLITS, "packed"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_one_step_is_the_full_batch_dpo_step(kind: str, split: str, dtype: torch.dtype) -> None:
    gap, _, _ = one_process(kind, split, dtype)
    print(f"{kind} {split} {dtype}: relative L2 to the oracle step {gap:.2e}")
    assert gap <= BOUNDS[dtype]


def test_rso_loss_is_exact_too() -> None:
    gap, _, _ = one_process("full", "3-1-4", torch.float32, "rso")
    print(f"rso 3-1-4: {gap:.2e}")
    assert gap <= ORACLE_BOUND


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_mean_of_micro_batch_means_is_far_off(kind: str) -> None:
    """Stock's weighting (each micro-batch's mean over ga) on the 3-1-4 regrouping: the oracle
    sees it, so the checks above can fail."""
    case = Case(kind)
    real_step(case, SPLITS["3-1-4"], mode=NormMode.NAIVE)
    gap = case.gap()
    print(f"{kind} naive 3-1-4: {gap:.2e}")
    assert gap > 100 * ORACLE_BOUND


# --- (b) two ranks under FSDP2, unequal pairs, one emptied filler -----------------------------


def _two_rank_worker(rank: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for kind in ("full", "lora", "packed"):
        case = Case("full" if kind == "packed" else kind)
        for model in (case.model, case.ref_model):
            if model is not None:
                shard_model(model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
        if kind == "packed":  # each rank packs its own pairs, rows dealt as the loader deals
            rank_pairs = [i for row in RANK_GROUPS[rank] for i in row]
            groups = packed_rows(rank_pairs)
            metrics, num_fillers = real_step(case, groups, by_budget=True, packed=True)
        else:
            metrics, num_fillers = real_step(case, RANK_GROUPS[rank], by_budget=True)
        results[kind] = {
            "gap": case.gap(),
            "metrics": metrics,
            "oracle_metrics": case.oracle_metrics(),
            "fillers": num_fillers,
        }
    return results


def _is_layer(name: str, module: nn.Module) -> bool:
    return name.startswith("layers.") and name.count(".") == 1


def test_two_ranks_with_unequal_pairs_and_a_filler_take_the_full_batch_step(tmp_path) -> None:
    results = run_on_ranks(_two_rank_worker, (), tmp_path)
    for kind in ("full", "lora", "packed"):
        on_rank = [r[kind] for r in results]
        assert [r["fillers"] for r in on_rank] == ([0, 2] if kind == "packed" else [0, 1])
        assert on_rank[0]["gap"] == on_rank[1]["gap"]  # the same full weights on both ranks
        assert on_rank[0]["metrics"] == on_rank[1]["metrics"]
        fillers = on_rank[1]["fillers"]
        print(f"{kind} 2 ranks (5 + 3 pairs, {fillers} filler(s)): {on_rank[0]['gap']:.2e}")
        assert on_rank[0]["gap"] <= ORACLE_BOUND
        oracle = on_rank[0]["oracle_metrics"]
        assert on_rank[0]["metrics"] == pytest.approx(oracle, **METRIC_TOLERANCE[torch.float32])


# --- (c) bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_a_pair_whose_response_is_all_prompt_is_named(side: str) -> None:
    pairs = make_pairs(SPECS[:3])
    pairs[1][f"{side}_labels"] = [IGNORE_INDEX] * len(pairs[1][f"{side}_labels"])
    units = PreferencePairs()
    with pytest.raises(ValueError, match=f"preference pair 1 of a micro-batch of 3: its {side}"):
        units.count(collate_pairs(pairs))
    # A response whose one label sits at position 0 has none after the shift.
    pairs = make_pairs([(0, 1, 4)] if side == "chosen" else [(0, 4, 1)])
    with pytest.raises(ValueError, match=f"pair 0 of a micro-batch of 1: its {side} response"):
        units.count(collate_pairs(pairs))


def test_a_loss_that_reduces_its_pairs_is_refused() -> None:
    model, loss_fn = tiny_model(), DPOLoss(beta=BETA)

    def mean_loss(*log_probs):
        losses, chosen, rejected = loss_fn(*log_probs)
        return losses.mean(), chosen, rejected

    batch = collate_pairs(PAIRS[:2])
    with pytest.raises(ValueError, match="must not reduce"):
        dpo_micro_batch_loss(
            model, mean_loss, batch, frozen_model_reference(freeze_model(tiny_model()))
        )


# --- (d) metrics --------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_metrics_are_the_full_batch_means_whatever_the_split(
    kind: str, split: str, dtype: torch.dtype
) -> None:
    _, metrics, oracle = one_process(kind, split, dtype)
    assert set(metrics) == set(PreferenceMetrics.NAMES)
    assert metrics == pytest.approx(oracle, **METRIC_TOLERANCE[dtype])


def test_an_emptied_micro_batch_holds_no_pair_and_a_finite_loss() -> None:
    units, case = PreferencePairs(), Case("full")
    batch = collate_pairs(PAIRS[:3])
    for source in (batch, {k: v[-1:] for k, v in batch.items()}):  # as filler_micro_batch cuts
        emptied = units.emptied(source)
        assert units.count(emptied) == 0 and emptied["tokens"].size(0) == 2
        prepared = units.prepare(emptied, 0, runs_empty=True)
        metrics = PreferenceMetrics()
        loss = dpo_micro_batch_loss(
            case.model, case.loss_fn, prepared, case.reference(), metrics=metrics
        ).main
        assert torch.isfinite(loss) and metrics._sums is None
        assert EMPTY not in prepared and LOSS_POSITIONS not in prepared  # the step popped them


# --- (e) logits only at response positions ------------------------------------------------------


def test_the_projection_sees_only_response_positions_and_the_loss_is_the_full_logits_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model(tie_word_embeddings=False)
    reference = frozen_model_reference(freeze_model(tiny_model(seed=7)))
    loss_fn = DPOLoss(beta=BETA)
    rows_projected: list[int] = []
    model.output.register_forward_hook(
        lambda module, args, out: rows_projected.append(args[0].reshape(-1, 32).size(0))
    )
    batch = PreferencePairs().prepare(collate_pairs(PAIRS), 8, runs_empty=False)
    num_responses = sum(
        len(p[f"{s}_input_ids"]) - num_prompt_positions(p, s) for p in PAIRS for s in SIDES
    )
    assert len(batch[LOSS_POSITIONS]) == num_responses
    assert num_responses < batch["tokens"].numel() / 2  # most positions are prompt or padding

    def loss_and_grads(batch):
        model.zero_grad()
        loss = dpo_micro_batch_loss(model, loss_fn, dict(batch), reference).main
        loss.backward()
        return float(loss.detach()), flat([p.grad for p in model.parameters()])

    cut_loss, cut_grads = loss_and_grads(batch)
    assert rows_projected == [num_responses]
    monkeypatch.setattr(forward, "projecting_only", _never_cut)  # where the log-probs project
    full_loss, full_grads = loss_and_grads(batch)
    assert rows_projected[-1] == batch["tokens"].numel()  # every position, as stock projects
    assert cut_loss == pytest.approx(full_loss, rel=1e-6)
    assert float((cut_grads - full_grads).norm() / full_grads.norm()) < 1e-6


def num_prompt_positions(pair: dict, side: str) -> int:
    """Positions of ``side`` scored by nothing: its prompt (labels masked)."""
    return sum(label == IGNORE_INDEX for label in pair[f"{side}_labels"])


@contextlib.contextmanager
def _never_cut(model, positions):
    yield False
