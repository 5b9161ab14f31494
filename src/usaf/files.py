"""The names of the files usaf writes and reads, in one place."""

STORE_FILE = "usaf_store.json"  # a prepared store's metadata (formats, source checksums, version)
STORE_FORMAT_VERSION = 1  # the version of STORE_FILE this usaf writes and reads
RUN_BASE_FILE = "base.json"  # a run's record of the base it trains on, written when the run starts
CONFIG_FILE = "config.yaml"  # a run's configuration
MERGED_METADATA_FILE = "usaf_delta.json"  # beside a merged checkpoint: what was written into it
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's index
METRICS_FILE = "metrics.jsonl"  # a run's rows, one JSON object per logged step
ROUTER_LOAD_FILE = "router_load.json"  # a run's expert loads per layer, for the heatmaps
SELECTION_FILE = "selection.safetensors"  # a run's (or usaf select's) selection: what is trained
SELECTION_AXES_FILE = "selection.json"  # beside a selection: the axes of each tensor's selection
SUMMARY_FILE = "summary.json"  # a finished run's summary
TRAINABLE_FILE = "trainable.safetensors"  # a checkpoint's trained values and selections
OPTIMIZER_FILE = "optimizer.safetensors"  # a checkpoint's optimizer state
RNG_FILE = "rng.safetensors"  # a checkpoint's random number generators' states
# an expert-parallel checkpoint's shard of EP rank `rank` of `size`: its experts' trained entries, their optimizer
# state, its components' own tensors (the reselector's probes of its experts; the rest, replicated on every rank,
# stays in TRAINABLE_FILE, OPTIMIZER_FILE and EXTRA_FILE). Checkpoints of usaf before the last had no EXTRA_SHARD_FILE
TRAINABLE_SHARD_FILE = "trainable-ep{rank}-of-{size}.safetensors"
OPTIMIZER_SHARD_FILE = "optimizer-ep{rank}-of-{size}.safetensors"
EXTRA_SHARD_FILE = "extra-ep{rank}-of-{size}.safetensors"
EXTRA_FILE = "extra.safetensors"  # a checkpoint's components' tensors (the reselector's statistics, ...)
RUN_MARKER = ".usaf-run"  # written first by every new run: the folder (and its config.yaml) is usaf's
LOCK_FILE = ".usaf-lock"  # held by the one process writing a run
DEMO_MARKER = "usaf_demo.json"  # in a `usaf demo` output folder: a later demo may replace the folder
DELTA_FORMAT = "usaf-delta"  # a delta file's safetensors metadata `format`
STATE_FILE = (
    "state.json"  # a checkpoint's run state (data position, counters, settings) and its files' sha256
)
STATE_SUM_FILE = "state.sha256"  # written last in a checkpoint: the sha256 of its state.json
