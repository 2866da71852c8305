"""Bad dataset rows fail with the row, the dataset and the problem, never deep in a loader.

torchtune 0.6.1 reports a bad row from inside its transforms, without saying which row:
a column missing from one row of a JSON file arrives as ``None`` and fails as
``AssertionError: content must be of type List[Dict[str, Any]], got None``; a column missing
from every row is a bare ``KeyError: 'output'``. Worse, the Alpaca transform formats the
instruction and input into its prompt with ``str.format``, so an ``"instruction": 7`` or a
``{...}`` trains silently on the text ``7``. And a token id beyond the model's embedding table
fails on CUDA as a device-side assert, far from the tokenizer that produced it.

:func:`checked_dataset` wraps the dataset a recipe instantiates. See [checked rows].

Note [checked rows]
Two kinds of check, chosen so that a good dataset pays next to nothing:

- At start-up, the columns of the datasets whose columns we know (the Alpaca, input/output,
  ShareGPT and OpenAI transforms, and the preference pairs of ``ChosenRejectedToMessages``, also
  inside a ``ConcatDataset`` or ``PackedDataset``) are checked from the Arrow schema: a column
  of the right type without nulls costs O(1), and only a column that is not one is scanned, to
  name its first bad row. A wrong type then fails before the first step instead of hours into
  an epoch, or never.
- Per sample, in the DataLoader: any exception from loading or transforming a row becomes a
  ``ValueError`` naming the row, and the tokenized sample must hold ``tokens`` and ``labels``
  of equal length with every id in ``[0, vocab_size)``; a preference pair must hold both its
  sides so, each with a response label after the shift (the checks are
  exactga.data.rows's). That is a min and a max over at most ``max_seq_len`` ints on the
  host, small next to tokenizing the row.

Rows are counted from 0, and the messages say so ("dataset row 5 (0-based)": the sixth), in
the order of the dataset as instantiated (after any ``filter_fn``); for a JSON file without a
filter that is the position in the file, and ``datasets``' own indexing (``ds[5]``). Under a list
of datasets (a ``ConcatDataset``) a row is counted within its own dataset, ``dataset[i]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.data import (
    AlpacaToMessages,
    ChosenRejectedToMessages,
    InputOutputToMessages,
    OpenAIToMessages,
    ShareGPTToMessages,
)
from torchtune.datasets import (
    ConcatDataset,
    PackedDataset,
    PreferenceDataset,
    SFTDataset,
    TextCompletionDataset,
)

from exactga.config.options import RankBalancing
from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.data.collation import micro_batch_collate
from exactga.data.files import read_data_files
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    SampleWindow,
    WindowCollator,
    whole_micro_batches,
)
from exactga.data.packing import uses_flex_attention
from exactga.data.rank_balancing import window_sampler
from exactga.data.rows import (
    is_preference_sample,
    pair_problem,
    sequence_problem,
    tokenizer_max_seq_len,
)

# The columns each known message transform reads, by their default name (a column map may rename
# them): the type of value it expects, and whether a row may leave the column empty (null or
# absent). Only the columns are checked up front; what is inside a conversation is checked by
# the transform itself, and a failure there is reported by row (see [checked rows]).
_COLUMNS: dict[type, dict[str, tuple[type, bool]]] = {
    AlpacaToMessages: {"instruction": (str, False), "input": (str, True), "output": (str, False)},
    InputOutputToMessages: {"input": (str, False), "output": (str, False)},
    ShareGPTToMessages: {"conversations": (list, False)},
    OpenAIToMessages: {"messages": (list, False)},
    ChosenRejectedToMessages: {"chosen": (list, False), "rejected": (list, False)},
}


# Note [data order]
# What a run trains on, and in which order, is decided here for every recipe: the dataset (one
# section, or a list concatenated in order), wrapped so bad rows are named; a
# ``StatefulDistributedSampler`` with seed 0 (torchtune's choice; the epoch is mixed in by
# ``sampler.set_epoch``), over which rank ``r`` of ``n`` reads every n-th sample of the one
# shuffled order (each window of it dealt by length under ``rank_balancing: by_tokens``, see
# [balanced ranks are exact]), so the ranks together see exactly what one device sees; windows
# of ``batch_size x gradient_accumulation_steps`` samples of that order, an epoch's last keeping
# only whole micro-batches of ``batch_size`` (the samples torchtune's loader, which drops its last
# short batch, would give); each window split into micro-batches by ``micro_batching`` (see
# [micro-batching modes] in exactga.data.micro_batching) and collated (exactga.data.collation). A
# resumed run hands the loader's saved position back here.


def load_dataset(
    cfg_dataset: DictConfig | ListConfig, tokenizer: Any, vocab_size: int, key: str = "dataset"
) -> Dataset:
    """The configured dataset (a list of sections is concatenated), with its rows checked;
    messages name it as the config ``key`` (``dataset_val`` for a validation set).

    See [data order], [data file faults] in exactga.data.files and [checked rows].
    """
    if isinstance(cfg_dataset, ListConfig):
        dataset: Dataset = ConcatDataset(
            datasets=[
                _build_section(section, tokenizer, f"{key}[{index}]")
                for index, section in enumerate(cfg_dataset)
            ]
        )
    else:
        dataset = _build_section(cfg_dataset, tokenizer, key)
    source = dataset_source(cfg_dataset, key)
    return checked_dataset(dataset, vocab_size=vocab_size, source=source)


def _build_section(section: DictConfig, tokenizer: Any, key: str) -> Dataset:
    """One dataset section, its unreadable or row-less files named (exactga.data.files)."""
    return read_data_files(lambda: config.instantiate(section, tokenizer), section, key)


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    gradient_accumulation_steps: int,
    shuffle: bool,
    collate_fn: str,
    padding_idx: int,
    ignore_idx: int,
    micro_batching: MicroBatchingSettings | None = None,
    drop_partial_window: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
    state_dict: Mapping[str, Any] | None = None,
    flex_attention: bool = False,
    rank_balancing: RankBalancing = RankBalancing.NONE,
) -> WindowLoader:
    """The loader of this data-parallel ``rank`` of ``num_replicas``: one accumulation window
    of samples at a time, split into micro-batches. See [data order] and [micro-batching modes].

    Args:
        dataset: from :func:`load_dataset`.
        batch_size: samples per micro-batch on this rank (the config's ``batch_size``).
        gradient_accumulation_steps: micro-batches of ``batch_size`` per window.
        shuffle: the config's ``shuffle``.
        collate_fn: the config's ``collate_fn`` (dotted path), used unless the data is packed.
        padding_idx: the tokenizer's pad id.
        ignore_idx: the loss's ignore index, which padded labels take.
        micro_batching: how a window is split; ``None`` is ``fixed`` (the loader's order).
        drop_partial_window: drop an epoch's last, short window instead of stepping on it.
        num_replicas: data-parallel ranks reading the dataset.
        rank: this process's data-parallel rank.
        state_dict: a saved loader position to go on from (resume), or ``None``.
        flex_attention: ``packed`` rows carry a ``BlockMask`` (CUDA), see exactga.data.packing.
        rank_balancing: ``by_tokens`` deals windows by length, see exactga.data.rank_balancing.

    Raises:
        ValueError: ``collate_fn`` is torchtune's inference-only left-padding collate, or
            ``packed`` micro-batches meet packed data or a collate of the user's own.
    """
    if "left_pad_sequence" in collate_fn:
        raise ValueError("config key 'collate_fn': left_pad_sequence is for inference only.")
    settings = micro_batching or MicroBatchingSettings(batch_size=batch_size)
    assert settings.batch_size == batch_size, "micro_batching was set up for another batch_size"
    collate = micro_batch_collate(
        settings,
        collate_fn,
        padding_idx,
        ignore_idx,
        packed_data=_is_packed(dataset),
        flex_attention=flex_attention,
    )
    window_size = batch_size * gradient_accumulation_steps
    sampler = window_sampler(
        dataset,
        rank_balancing,
        window_size=window_size,
        micro_batching=settings,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
    )
    dataloader = _stateful_loader(
        dataset=dataset,
        batch_size=window_size,
        sampler=sampler,
        collate_fn=WindowCollator(settings, window_size, collate),
        drop_last=False,  # the short last window keeps its whole micro-batches
        # Each new iterator draws a worker seed from this generator; from the global RNG (the
        # default) that draw came after a resume's RNG restore, so a run that draws from it
        # while training (bf16 stochastic rounding, dropout) went on from a shifted stream.
        generator=torch.Generator(),
    )
    loader = WindowLoader(dataloader, batch_size, window_size, drop_partial_window)
    if state_dict is not None:
        loader.load_state_dict(state_dict)
    return loader


def dataloader_from_settings(
    dataset: Dataset,
    settings: SingleDeviceRecipeConfig,
    micro_batching: MicroBatchingSettings,
    *,
    padding_idx: int,
    ignore_idx: int,
    num_replicas: int = 1,
    rank: int = 0,
    rank_balancing: RankBalancing = RankBalancing.NONE,
    state_dict: Mapping[str, Any] | None = None,
) -> WindowLoader:
    """:func:`build_dataloader` with the batching keys of a recipe's typed settings
    (``batch_size``, ``gradient_accumulation_steps``, ``drop_partial_window``, ``shuffle``,
    ``collate_fn``, and ``device`` for a packed row's mask) and its ``micro_batching``
    (``MicroBatchingSettings.from_settings``, read once: the profiler names it too), read here
    once for every training recipe so that no recipe can build its windows differently."""
    return build_dataloader(
        dataset,
        batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        micro_batching=micro_batching,
        drop_partial_window=settings.drop_partial_window,
        shuffle=settings.shuffle,
        collate_fn=settings.collate_fn,
        padding_idx=padding_idx,
        ignore_idx=ignore_idx,
        num_replicas=num_replicas,
        rank=rank,
        state_dict=state_dict,
        flex_attention=uses_flex_attention(settings.device),
        rank_balancing=rank_balancing,  # the distributed schemas' key; one rank has none
    )


def build_prompt_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    num_replicas: int = 1,
    rank: int = 0,
    state_dict: Mapping[str, Any] | None = None,
) -> StatefulDataLoader:
    """The GRPO recipe's loader: ``batch_size`` prompts (dataset items, uncollated) per step
    on this ``rank``. The ranks deal their batches out of one shuffled order of the dataset
    (see [data order]), so a step's prompts over every rank are the same whatever the number of
    ranks, as long as ``batch_size x num_replicas`` is; ``drop_last`` as every rank needs its
    ``batch_size`` prompts."""
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=0
    )
    loader = _stateful_loader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=list,  # prompts stay items: generation takes them one by one
        drop_last=True,
        generator=torch.Generator(),  # see build_dataloader
    )
    if state_dict is not None:
        loader.load_state_dict(state_dict)
    return loader


def _stateful_loader(*args: Any, **kwargs: Any) -> StatefulDataLoader:
    """torchdata's ``StatefulDataLoader`` without its warning ``'set_vital' is deprecated``:
    its constructor calls torch's deprecated ``torch.set_vital`` (torchdata 0.11 with torch
    2.9 and later), a note to torchdata's authors that a user can do nothing about, printed once
    per rank on every run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(*args, **kwargs)


class WindowLoader:
    """A stateful loader of :class:`SampleWindow`s: one per optimizer step of an epoch.

    Wraps torchdata's ``StatefulDataLoader`` (whose batches are windows of samples) and applies
    the end-of-epoch rules: a last window without a whole micro-batch is not a window, and with
    ``drop_partial_window`` nor is a short one. ``sampler``, ``state_dict`` and
    ``load_state_dict`` are the wrapped loader's.
    """

    def __init__(
        self,
        dataloader: StatefulDataLoader,
        batch_size: int,
        window_size: int,
        drop_partial_window: bool,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = dataloader.sampler
        self.batch_size = batch_size
        self.window_size = window_size
        self.drop_partial_window = drop_partial_window

    def __len__(self) -> int:
        """Windows in an epoch on this rank."""
        full, rest = divmod(len(self.sampler), self.window_size)
        has_partial = whole_micro_batches(rest, self.batch_size) > 0
        return full + (1 if has_partial and not self.drop_partial_window else 0)

    def __iter__(self) -> Iterator[SampleWindow]:
        for window in self.dataloader:
            if window.num_samples == 0 or (window.is_partial and self.drop_partial_window):
                continue  # only an epoch's last window can be short; see [micro-batching modes]
            yield window

    def state_dict(self) -> dict[str, Any]:
        return {"window_size": self.window_size, "loader": self.dataloader.state_dict()}

    def skip_samples_of_epoch(self, samples: int | None) -> None:
        """Go on at sample ``samples`` of the epoch's order, counted over every rank (``None``:
        its first): each rank skips its share. A resume on another number of ranks; see
        [resharded resume] in exactga.run.resume.

        Raises:
            ValueError: the count does not split evenly over this loader's ranks.
        """
        if samples is None:
            return
        ranks = self.sampler.num_replicas
        per_rank, rest = divmod(samples, ranks)
        if rest:
            raise ValueError(
                f"resume_from_checkpoint: the checkpoint's run had read {samples} samples of the "
                f"epoch over all ranks, which do not split over {ranks} ranks; resume on a number "
                "of ranks that divides the global batch."
            )
        self.sampler.load_state_dict({"yielded": per_rank})  # read by the sampler's next pass

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if "window_size" not in state_dict:
            raise ValueError(
                "resume_from_checkpoint: this checkpoint's data-loader position was saved by an "
                "exactga that loaded micro-batches, not windows; resume it with that version, or "
                "start the run again."
            )
        # A window size changed across a resume (batch_size or gradient_accumulation_steps, in
        # resume_allow_changed_keys) is fine: the sampler's position counts samples.
        self.dataloader.load_state_dict(state_dict["loader"])


def _is_packed(dataset: Dataset) -> bool:
    """Whether samples are packs (``packed: True``); :class:`CheckedDataset` says so."""
    return isinstance(dataset, PackedDataset) or getattr(dataset, "packed", False) is True


def checked_dataset(dataset: Dataset, vocab_size: int, source: str) -> Dataset:
    """``dataset`` with bad rows reported by row, ``source`` and problem. See [checked rows].

    Args:
        dataset: the map-style dataset a recipe instantiated (an ``SFTDataset`` or a
            ``PreferenceDataset``, or a ``ConcatDataset`` or ``PackedDataset`` of them, or any
            other).
        vocab_size: rows of the model's embedding table; token ids must be below it.
        source: the dataset as the user configured it, for messages, e.g.
            ``"dataset (json: configs/tiny/data.json)"``.

    Raises:
        ValueError: at once, for a text column of a known dataset that is missing or holds a
            value that is not a string (naming the first such row); later, from
            ``__getitem__``, for any row that fails to load or tokenize.
    """
    assert vocab_size > 0, f"vocab_size must be positive, got {vocab_size}"
    for part, part_source in _message_datasets(dataset, source):
        _check_columns(part, part_source)
    return CheckedDataset(dataset, vocab_size, source)


def dataset_source(cfg_dataset: Any, key: str = "dataset") -> str:
    """How the user configured the dataset, for messages: its source and files, or builder."""
    sections = list(cfg_dataset) if OmegaConf.is_list(cfg_dataset) else [cfg_dataset]
    described = []
    for section in sections:
        where = section.get("data_files") or section.get("source") or section.get("_component_")
        kind = section.get("source") or section.get("_component_")
        described.append(f"{kind}: {where}" if where != kind else str(kind))
    return f"{key} ({'; '.join(described)})"


def model_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's token embedding table (torchtune decoders: ``tok_embeddings``)."""
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is None or not hasattr(embeddings, "num_embeddings"):
        raise ValueError(
            f"config key 'model': {type(model).__name__} has no tok_embeddings table, so token "
            "ids cannot be checked against its vocabulary; this recipe trains decoders that do."
        )
    return int(embeddings.num_embeddings)


class CheckedDataset(Dataset):
    """Forwards to the wrapped dataset; see :func:`checked_dataset`.

    Attributes the recipes read are forwarded, so the wrapper is a drop-in; ``packed`` says
    whether a sample is a pack of rows (a ``PackedDataset``, or a concatenation of them).
    """

    def __init__(self, dataset: Dataset, vocab_size: int, source: str) -> None:
        self._dataset = dataset
        self._vocab_size = vocab_size
        self._source = source
        # A packed dataset's index is a pack of several rows, not a row of the file.
        self.packed = _is_packed(dataset)
        self._unit = "packed sample" if self.packed else "dataset row"

    def __len__(self) -> int:
        return len(self._dataset)

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally. Dunders and a half-built instance (during
        # unpickling in a DataLoader worker) must not recurse into the wrapped dataset.
        if name.startswith("__") or "_dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._dataset, name)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            sample = self._dataset[index]
        except Exception as err:
            raise ValueError(f"{self._where(index)}: {_describe(err)}") from err
        self._check_sample(index, sample)
        return sample

    def _where(self, index: int) -> str:
        _, index, source = self._locate(index)
        return f"{self._unit} {index} (0-based) of {source}"

    def _locate(self, index: int) -> tuple[Dataset, int, str]:
        """The dataset holding ``index``, the index within it, and its name for messages."""
        if isinstance(self._dataset, ConcatDataset) and not self.packed:
            for start, stop, part in self._dataset._indexes:  # (first, end, dataset) per part
                if start <= index < stop:
                    part_dataset = self._dataset._datasets[part]
                    return part_dataset, index - start, f"{self._source}[{part}]"
        return self._dataset, index, self._source

    def _check_sample(self, index: int, sample: Any) -> None:
        problem = self._sample_problem(index, sample)
        if problem is not None:
            raise ValueError(f"{self._where(index)}: {problem}")

    def _sample_problem(self, index: int, sample: Any) -> str | None:
        """What is wrong with a tokenized sample, an SFT one or a preference pair, or None."""
        if is_preference_sample(sample):
            max_seq_len = tokenizer_max_seq_len(self._locate(index)[0])
            return pair_problem(sample, self._vocab_size, max_seq_len)
        if not isinstance(sample, Mapping) or "tokens" not in sample or "labels" not in sample:
            keys = ", ".join(map(str, sample)) if isinstance(sample, Mapping) else type(sample)
            return (
                f"a sample must hold 'tokens' and 'labels', got {keys}. (A preference sample "
                "holds 'chosen_input_ids', 'chosen_labels', 'rejected_input_ids' and "
                "'rejected_labels' instead.)"
            )
        return sequence_problem(sample["tokens"], sample["labels"], self._vocab_size)


def _describe(err: Exception) -> str:
    if isinstance(err, KeyError):
        # The message transforms read columns by name; a KeyError is nearly always one missing.
        return f"missing column or key {err.args[0]!r} (KeyError)"
    return f"{type(err).__name__}: {err}"


def _message_datasets(dataset: Dataset, source: str) -> Iterator[tuple[Dataset, str]]:
    """The ``SFTDataset``s, ``PreferenceDataset``s and ``TextCompletionDataset``s inside
    ``dataset`` (each keeps its rows in ``_data``), each with the name its messages should
    use."""
    if isinstance(dataset, (SFTDataset, PreferenceDataset, TextCompletionDataset)):
        yield dataset, source
    elif isinstance(dataset, PackedDataset):
        yield from _message_datasets(dataset.ds, source)
    elif isinstance(dataset, ConcatDataset):
        for i, part in enumerate(getattr(dataset, "_datasets", [])):
            yield from _message_datasets(part, f"{source}[{i}]")


def _check_columns(dataset: Dataset, source: str) -> None:
    """Raise naming the first row whose column is absent or of the wrong type.

    Only for message transforms whose columns we know, and text completion's one column; any
    other dataset is left to the per-sample checks. See [checked rows].
    """
    transform = getattr(dataset, "_message_transform", None)
    columns = _COLUMNS.get(type(transform))
    # Alpaca and input/output keep their map public, the chat and preference transforms private.
    column_map = getattr(transform, "column_map", None) or getattr(transform, "_column_map", {})
    if isinstance(dataset, TextCompletionDataset):  # its one column, config key 'column'
        columns, column_map = {dataset._column: (str, False)}, {}
    data = getattr(dataset, "_data", None)
    if columns is None or not hasattr(data, "features"):  # e.g. a streaming dataset
        return
    present = list(data.column_names)
    for default_name, (kind, optional) in columns.items():
        name = (column_map or {}).get(default_name, default_name)
        if name not in present:
            if optional:
                continue
            renamed = f" (column_map '{default_name}')" if name != default_name else ""
            raise ValueError(
                f"{source}: missing column '{name}'{renamed} in every row; its columns are "
                f"{', '.join(present)}."
            )
        if _is_clean_column(data, name, kind, allow_null=optional):
            continue
        for row, value in enumerate(data[name]):
            if value is None and not optional:
                raise ValueError(
                    f"dataset row {row} (0-based) of {source}: missing column '{name}' (absent "
                    "or null)."
                )
            if value is not None and not isinstance(value, kind):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise ValueError(
                    f"dataset row {row} (0-based) of {source}: column '{name}' must be a "
                    f"{_KIND[kind]}, "
                    f"got {type(value).__name__} {shown}."
                )


_KIND = {str: "string", list: "list"}


def _is_clean_column(data: Any, name: str, kind: type, allow_null: bool) -> bool:
    """Whether column ``name`` holds only ``kind`` (and no nulls, unless allowed), judged from
    the Arrow schema alone; False means "scan it"."""
    feature = data.features[name]
    if kind is str:
        typed = getattr(feature, "dtype", None) in ("string", "large_string")
    else:
        typed = type(feature).__name__ in ("List", "LargeList")
    if not typed:
        return False
    if allow_null:
        return True
    try:
        return data.data.column(name).null_count == 0
    except (AttributeError, KeyError):  # not Arrow-backed as expected: scan to be sure
        return False
