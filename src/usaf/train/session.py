"""What every command that runs a model starts from (`usaf train`, `eval`, `select`, the demo): the device and dtype,
the tokenizer, the data, the model loaded and prepared (from a folder, a prepared store or the hub), and the checks
between them: positions the model never saw, packed documents that would attend to each other."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub
import torch
from torch.distributed.tensor import DTensor

from usaf import kernels
from usaf.base.load import load_for_training
from usaf.config import RunConfig
from usaf.data import TokenizedDataset, load_run_data
from usaf.data.load import fit_context
from usaf.data.sources import absolute_name
from usaf.data.stream import batches_for
from usaf.data.templates import template_names
from usaf.engine import expert_parallel
from usaf.engine.state import model_state
from usaf.errors import ConfigError, ModelError, UsafError, first_line
from usaf.files import CONFIG_FILE
from usaf.io.model_source import is_local_path, model_source
from usaf.io.source import check_model_files
from usaf.model.hf import decoder_body, load_causal_lm, load_config, max_positions
from usaf.model.hf import load_tokenizer as hf_tokenizer
from usaf.prepare import current_selection, enable_recomputation, prepare_model
from usaf.selection.across_ranks import main_first
from usaf.selection.choose import resolved_selection
from usaf.train import distributed, runtime
from usaf.train.memory_plan import resolve_storage
from usaf.train.prompts import load_prompts
from usaf.train.recompute import choose_recompute
from usaf.train.tokenizer import has_tokenizer_files, model_vocabulary


def absolute_paths(config: RunConfig) -> RunConfig:
    """A copy of `config` with its local paths absolute (model.path as `with_model_source` resolves it; data
    files, select.file, a data.chat_template file)."""
    config = with_model_source(config)
    changes = {
        "data.train": [absolute_name(str(f)) for f in config.data.train],
        "data.eval": [absolute_name(str(f)) for f in config.data.eval],
    }
    if config.model.path and is_local_path(config.model.path):
        changes["model.path"] = os.path.abspath(os.path.expanduser(config.model.path))
    if config.select.file:
        changes["select.file"] = os.path.abspath(os.path.expanduser(config.select.file))
    template = config.data.chat_template
    if template and template not in template_names() and Path(template).expanduser().is_file():
        changes["data.chat_template"] = os.path.abspath(os.path.expanduser(template))
    return config.replace(changes)


def with_model_source(config: RunConfig) -> RunConfig:
    """A copy of `config` whose model.path is the folder `model_source` says is read (a cached hub id's snapshot)
    and whose model.quant is the one that load uses (a prepared store's own format: the user need not repeat it).
    A run is not a base to start from: it is refused in one line."""
    source = model_source(config.model.path)
    if source.is_run:
        raise ModelError(
            f"model.path {source.given} is a usaf run, not a model: continue it with `usaf train --resume "
            f"{source.given}`, or train on its merged export (`usaf export {source.given} --merged DIR`)."
        )
    return config.replace({"model.path": source.path, "model.quant": source.quant_for(config.model.quant)})


def config_for_model(path: str, overrides: list) -> RunConfig:
    """The configuration of a command that runs the model at `path` outside a run (eval, generate, chat): the
    defaults with `--set` overrides, model.path as `with_model_source` resolves it."""
    return with_model_source(RunConfig.load(None, [("model.path", path), *overrides]))


def config_of_run(run_dir: Path, overrides: list) -> RunConfig:
    """A run's own config.yaml with `--set` overrides (model.path as the run recorded it)."""
    return RunConfig.load_saved(str(run_dir / CONFIG_FILE), overrides)


def load_tokenizer(path: str):
    """The model's tokenizer; for a model folder without tokenizer files, a NoTokenizer (pre-tokenized data
    only, ids checked against config.vocab_size) instead of transformers' empty one."""
    check_model_path(path)
    if (Path(path).expanduser() / "config.json").is_file():
        check_model_files(path)  # an unreadable config.json is named as such, not as a tokenizer that failed
    if Path(path).expanduser().is_dir() and not has_tokenizer_files(Path(path).expanduser()):
        return model_vocabulary(path)
    try:
        return hf_tokenizer(path)
    except UsafError:
        raise
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the tokenizer of {path!r}: {err}") from None


def check_model_path(path: str) -> None:
    """A path that is not a directory is taken for a hub id only when it looks like one (`org/name`); anything
    else (`./run`, `models/x/y`, a typo) is a missing directory, said plainly instead of as a failed download."""
    p = Path(path).expanduser()
    if p.is_dir():
        return
    if is_local_path(path):
        raise ModelError(
            f"{path}: no such model directory (expected a folder with config.json and weights, or a "
            "hub id like Qwen/Qwen3-30B-A3B)."
        )
    _check_hub_reachable(path)


def _check_hub_reachable(repo_id: str, timeout_s: float = 3.0) -> None:
    """A hub id that is not in the local cache needs the hub: say so at once when it cannot be reached, instead
    of after the minute of retries transformers spends (a cached model loads offline as usual)."""
    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return
    constants = huggingface_hub.constants
    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"{repo_id}: not in the local hub cache and HF_HUB_OFFLINE is set; download it first "
            f"(huggingface-cli download {repo_id}) or pass a local folder."
        )
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy a direct connection says nothing: transformers finds out
    host = urlparse(os.environ.get("HF_ENDPOINT", constants.ENDPOINT)).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError as err:
        raise ModelError(
            f"{repo_id}: not in the local hub cache and {host} cannot be reached ({err.strerror or err}); "
            "connect to the network, download it elsewhere and copy the folder, or pass a local folder."
        ) from None


def load_model(
    config: RunConfig,
    device: torch.device,
    dtype: torch.dtype,
    calibration_batches=None,
    selection_file=None,
    recompute: bool | None = None,
):
    """The base model (from a directory or the hub), prepared for sparse training (with the selection in
    `selection_file` instead of choosing one, when given). `recompute`: per-layer recomputation, switched on
    before calibration so that calibration recomputes as training does (None: `train.recompute`, auto resolved by
    the planner)."""
    config = resolve_storage(config, device, dtype)  # model.quant/residency/cache_mb=auto (no-op in a run)
    path = config.model.path
    if recompute is None:
        recompute = choose_recompute(config, device, dtype).recompute
    if selection_file is not None:
        config = config.replace({"select.strategy": "file", "select.file": str(selection_file)})
    # a prepared store, or a published MXFP4/FP8 checkpoint (which trains on its own quantized experts, whatever
    # model.quant says), loads through the quantized path as a folder asked for model.quant does
    # (expert parallelism too, at any model.quant: a rank reads only its experts' slice of the store)
    if config.model.quant != "none" or model_source(path).quant != "none" or expert_parallel.layout():
        model = load_for_training(
            config.model,
            config.select,
            device,
            dtype,
            calibration_batches=calibration_batches,
            recompute=recompute,
        )
    else:
        if config.model.residency != "device":  # host/mmap keep a quantized store's experts off the device
            raise ConfigError(
                f"model.residency={config.model.residency} keeps a quantized base's experts in host memory; "
                "this base is not quantized (model.quant=none): set model.quant=nf4, int8 or int4, or "
                "model.residency=device."
            )
        check_model_files(path)
        try:
            model = load_causal_lm(path, dtype=dtype)
        except UsafError:
            raise
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load the model at {path!r}: {first_line(err)}") from None
        model.to(device)
        if recompute:
            enable_recomputation(model)
        prepare_model(model, config.select, calibration_batches=calibration_batches)
    return model


@torch.no_grad()
def check_finite_base(model: torch.nn.Module, seen: str) -> None:
    """A NaN/Inf `seen` before any update (the first step's loss, the first forward): a base weight with NaN/Inf
    is named (retrying the step or lowering the learning rate cannot help); read only on that failure."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    # the model's own weights first: usaf's trained values are copies of them
    for name, tensor in sorted(tensors, key=lambda item: ".usaf." in item[0]):
        if isinstance(tensor, DTensor):  # sharded by FSDP2 (`usaf.train.shard_dense`): every rank gathers it
            tensor = tensor.full_tensor()
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            raise ModelError(
                f"the base model has NaN/Inf values in tensor '{name}' ({seen}): training cannot start from it; "
                "use an intact copy of the model."
            )


def nothing_to_train(config: RunConfig) -> str | None:
    """Why `select` (targets, layers, train_router) picks no weight at all in any model, or None: known from the
    config alone, so a run is refused before its folder is made."""
    select = config.select
    if select.layers is not None and not select.layers:
        return (
            "select.layers is [] (no decoder layer, and with layers named nothing outside them trains): name some "
            "layers, or leave select.layers unset for all"
        )
    in_layers = [t for t in select.targets if t not in ("routers", "embeddings", "lm_head")]
    if select.trains_routers:
        in_layers.append("routers")
    outside = [t for t in select.targets if t in ("embeddings", "lm_head")] if select.layers is None else []
    if in_layers or outside:
        return None
    if select.targets == ["routers"]:
        return (
            "select.targets is [routers] with select.train_router=false: set train_router=true or add targets"
        )
    return (
        f"select.targets {select.targets} are outside the decoder layers, and select.layers={select.layers} "
        "leaves them frozen: add targets inside the layers (e.g. experts), or drop select.layers"
    )


def check_something_to_train(config: RunConfig) -> None:
    if (why := nothing_to_train(config)) is not None:
        raise ConfigError(f"nothing to train: {why}.")


def check_trainable_entries(model, config: RunConfig) -> None:
    """A prepared model with no trainable entry (targets this model does not have): refused before a step."""
    if not any(p.requires_grad and p.numel() for p in model.parameters()):
        raise ConfigError(
            f"nothing to train: select.targets {config.select.targets}"
            + (f" in select.layers {config.select.layers}" if config.select.layers is not None else "")
            + f" select no weight of the model at {config.model.path}; choose other targets (e.g. experts)."
        )


@torch.no_grad()
def packed_documents_are_isolated(model, device) -> bool:
    """Whether the model keeps packed documents apart: a document packed after another must give the same hidden
    states as alone. One forward of nine tokens, once per run: documents B, A, B packed (positions 0, 1, 2 each),
    where the first B, which nothing precedes, is B alone (causal attention) and the last B is B packed after
    two documents (a forward per case would cost a second pass over every expert the tokens route to)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    first, second = torch.arange(1, 4, device=device), torch.arange(4, 7, device=device)
    ids = torch.cat([second, first, second]).remainder(vocab).unsqueeze(0)
    positions = torch.arange(3, device=device).repeat(3).unsqueeze(0)
    hidden = decoder_body(model)(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    if not bool(torch.isfinite(hidden).all()):
        check_finite_base(model, "its first forward gives NaN/Inf, before any update")
    alone, packed = hidden[:, :3], hidden[:, 6:]
    return bool(torch.allclose(packed.float(), alone.float(), atol=1e-3, rtol=1e-3))


def selection_summary(model, config: RunConfig, chosen: dict | None = None) -> dict:
    """What the selection file records beside the selection: how it was made and its entries per tensor.
    `chosen`: the model's `current_selection`, when the caller has it (under expert parallelism a gather)."""
    chosen = current_selection(model) if chosen is None else chosen
    calibration = calibration_of(model)
    return {
        "strategy": config.select.strategy,
        "selection": resolved_selection(config.select, has_data=True),
        "granularity": config.select.granularity,
        "entries": {key: int(c.indices.numel()) for key, c in chosen.items()},
        "calibration": calibration.summary() if calibration is not None else None,
    }


def calibration_of(model):
    """The statistics the model's entries were chosen by (`usaf.selection.calibrate.Calibration`), or None."""
    prepared = model_state(model)
    return prepared.calibration if prepared is not None else None


def calibration_line(model, select) -> str | None:
    """What choosing the entries cost, for the run's first lines: calibration runs batches as steps do before the
    first step, and how many is the user's trade (select.calibration_*); None where nothing was calibrated (a
    resumed run, a selection from a file, a choice without data)."""
    calibration = calibration_of(model)
    if calibration is None or not calibration.batches:
        return None
    took = (
        f"calibration: {calibration.batches} batches, {calibration.supervised_tokens:,} supervised tokens in "
        f"{calibration.seconds:.1f} s"
    )
    if calibration.supervised_tokens < select.calibration_tokens:  # usaf train calibrates on one pass at most
        return (
            f"{took}: the whole training data, short of select.calibration_tokens={select.calibration_tokens}"
        )
    return (
        f"{took} (select.calibration_batches={select.calibration_batches}, select.calibration_tokens="
        f"{select.calibration_tokens}: more settle the choice of entries, fewer start sooner)"
    )


def check_positions(model_config, config: RunConfig, *datasets) -> None:
    """The data's rows within the model's max_position_embeddings, as loaded: what `usaf.data.load.fit_context`
    made sure of from config.json before tokenizing, checked again on the loaded model's config (a source whose
    config.json was not read there)."""
    if (limit := max_positions(model_config)) is None:
        return
    longest = max((d.max_seq_len for d in datasets if d is not None), default=0)  # loaded: never empty
    if longest > limit:
        raise ConfigError(
            f"data.max_seq_len={longest} is above the model's max_position_embeddings={limit} (config.json): "
            f"positions the model has never seen; set data.max_seq_len={limit} or less (longer records are split "
            "or truncated, and counted)."
        )


def run_data(config: RunConfig, tokenizer, pack: bool, files: list[str] | None = None, held_out: bool = True):
    """`usaf.data.load_run_data` handed the run's sections it reads (data, model, train): the `load_data` of
    `open_session` for a run. GRPO reads prompts (`usaf.train.prompts`): its completions are generated."""
    if config.train.objective == "grpo":
        return load_prompts(fit_context(config.data, config.model.path)[0], tokenizer, files)
    return load_run_data(config.data, config.model, config.train, tokenizer, pack, files, held_out)


PACKING_OFF = "this model lets packed documents attend to each other: packing is off for this run"


@dataclass
class Session:
    """A model ready to run on its data. `config` is the one in force: packing may have been turned off."""

    config: RunConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: object
    model: torch.nn.Module
    train_data: TokenizedDataset | None
    eval_data: TokenizedDataset | None
    data_stats: object
    notes: list[str] = field(default_factory=list)


def open_session(
    config: RunConfig,
    load_data: Callable[[RunConfig, object, bool], tuple],
    *,
    calibrate: bool = True,
    selection_file: Path | None = None,
    recompute: bool | None = None,
) -> Session:
    """Device, tokenizer, data (`load_data(config, tokenizer, pack)` -> train, eval, stats), then the model, then
    the packing check: a family whose attention ignores restarting position_ids (gpt-oss in transformers 5.24)
    would let packed documents attend to each other, so each document then gets its own row. `calibrate`: the
    selection calibrates on the training data (in its own order); `recompute`: None lets train.recompute decide."""
    config = with_model_source(config)
    kernels.use(config.train.kernels)
    device = distributed.local_device(
        runtime.resolve_device(config.model.device)
    )  # cuda:LOCAL_RANK under torchrun
    dtype = runtime.resolve_dtype(config.model.dtype, device)
    config = resolve_storage(config, device, dtype)  # eval's autos (a run's were resolved when it started)
    tokenizer = load_tokenizer(config.model.path)
    # rank 0 tokenizes first under torchrun: ranks building one datasets cache entry at once collide
    train_data, eval_data, stats = main_first(lambda: load_data(config, tokenizer, config.data.pack))
    if (folder := Path(config.model.path).expanduser()).is_dir() and (folder / "config.json").is_file():
        # before the model is loaded and calibrated (its files were checked by load_tokenizer); again below on the
        # loaded model's config for other sources
        check_positions(load_config(folder), config, train_data, eval_data)
    calibration = None
    if calibrate and train_data is not None:
        # one pass at most: calibration never sees a batch twice (select.calibration_tokens may ask for more)
        calibration = batches_for(train_data, config.data.batch_size, seed=config.train.seed + 1, epochs=1)
    model = load_model(
        config,
        device,
        dtype,
        calibration_batches=calibration,
        selection_file=selection_file,
        recompute=recompute,
    )
    check_positions(model.config, config, train_data, eval_data)
    notes = []
    if config.data.pack and not packed_documents_are_isolated(model, device):
        notes.append(PACKING_OFF)
        config = config.replace({"data.pack": False})
        train_data, eval_data, stats = main_first(lambda: load_data(config, tokenizer, False))
    return Session(config, device, dtype, tokenizer, model, train_data, eval_data, stats, notes)
