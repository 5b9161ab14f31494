"""A merged export converted to GGUF (llama.cpp, Ollama, LM Studio) by llama.cpp's own tools.

usaf does not reimplement `convert_hf_to_gguf.py` nor `llama-quantize`: llama.cpp keeps its tensor names, tokenizer
handling and quantization types up to date, and a merged export is a plain Hugging Face checkpoint it already reads.
usaf finds the converter, runs it on the merged folder with the interpreter usaf runs in (for the types the
converter writes itself), or converts to 16 bits and runs `llama-quantize` on that (the k-quants and the other
types only llama-quantize writes), and puts the file in place only once everything has finished.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from usaf.errors import ConfigError, UsafError
from usaf.io.atomic import atomic_file, temporary_name
from usaf.io.guard import GGUF

CONVERTER = "convert_hf_to_gguf.py"
QUANTIZE = "llama-quantize"
# written by the converter itself
CONVERTER_OUTTYPES = ("f16", "bf16", "q8_0", "f32")
# written by llama-quantize from a 16-bit conversion: its types that need no importance matrix
QUANTIZE_OUTTYPES = (
    "q4_k_m",
    "q4_k_s",
    "q5_k_m",
    "q5_k_s",
    "q6_k",
    "q3_k_m",
    "q3_k_s",
    "q3_k_l",
    "q2_k",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "iq4_nl",
    "iq4_xs",
)
OUTTYPES = CONVERTER_OUTTYPES + QUANTIZE_OUTTYPES
ENVIRONMENT = "LLAMA_CPP"
QUANTIZE_ENVIRONMENT = "LLAMA_QUANTIZE"
INSTALL_HINT = (
    "get llama.cpp (git clone https://github.com/ggml-org/llama.cpp, then pip install -r "
    "llama.cpp/requirements/requirements-convert_hf_to_gguf.txt) and pass --llama-cpp DIR or set LLAMA_CPP=DIR"
)
QUANTIZE_HINT = (
    "build it in your llama.cpp checkout (cmake -B build && cmake --build build --target llama-quantize), put it on "
    "PATH or set LLAMA_QUANTIZE=PATH, or choose an --outtype the converter writes itself ("
    + ", ".join(CONVERTER_OUTTYPES)
    + ")"
)


def _vendored() -> list[Path]:
    """Packages that carry llama.cpp's source with its converter (llama-cpp-python's vendor folder)."""
    found = []
    for package in ("llama_cpp",):
        spec = importlib.util.find_spec(package)  # finds without importing (no code of the package runs)
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                found += [
                    Path(location) / "vendor" / "llama.cpp",
                    Path(location).parent / "vendor" / "llama.cpp",
                ]
    return found


def find_converter(llama_cpp: str | None) -> Path:
    """The converter script: in --llama-cpp DIR, else $LLAMA_CPP, else on PATH, else in a package that vendors
    llama.cpp. A given folder without it is an error, not a reason to look elsewhere."""
    for given, label in ((llama_cpp, "--llama-cpp"), (os.environ.get(ENVIRONMENT), ENVIRONMENT)):
        if given:
            folder = Path(given).expanduser()
            script = folder / CONVERTER if folder.is_dir() else folder
            if script.name != CONVERTER or not script.is_file():
                raise UsafError(
                    f"{label} {given} holds no {CONVERTER}; give the folder of a llama.cpp checkout."
                )
            return script
    on_path = shutil.which(CONVERTER)
    if on_path is not None:
        return Path(on_path)
    for folder in _vendored():
        if (folder / CONVERTER).is_file():
            return folder / CONVERTER
    raise UsafError(f"--gguf needs llama.cpp's {CONVERTER}, which was not found: {INSTALL_HINT}.")


def check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}.")


def find_quantize(converter: Path) -> Path:
    """llama.cpp's `llama-quantize`: $LLAMA_QUANTIZE, else built beside the converter (its checkout's build/bin,
    as llama.cpp's cmake build puts it), else on PATH."""
    given = os.environ.get(QUANTIZE_ENVIRONMENT)
    if given:
        tool = Path(given).expanduser()
        if not (tool.is_file() and os.access(tool, os.X_OK)):
            raise UsafError(f"{QUANTIZE_ENVIRONMENT}={given} is not an executable file: {QUANTIZE_HINT}.")
        return tool
    for built in (converter.parent / "build" / "bin" / QUANTIZE, converter.parent / QUANTIZE):
        if built.is_file() and os.access(built, os.X_OK):
            return built
    on_path = shutil.which(QUANTIZE)
    if on_path is not None:
        return Path(on_path)
    raise UsafError(f"--outtype needs llama.cpp's {QUANTIZE}, which was not found: {QUANTIZE_HINT}.")


def model_name(base_dir: Path, run_dir: Path | None) -> str:
    """The GGUF's general.name: the base's name (a hub id's repository name where the base is a hub cache
    snapshot, else its folder's name), followed by the run's folder name for a run."""
    base_dir = Path(base_dir).resolve()
    name = base_dir.name
    if base_dir.parent.name == "snapshots" and base_dir.parent.parent.name.startswith("models--"):
        name = base_dir.parent.parent.name.split("--")[
            -1
        ]  # huggingface_hub's models--ORG--NAME/snapshots/REV
    return f"{name}-{Path(run_dir).resolve().name}" if run_dir is not None else name


def _run(command: list[str], tool: str, shown: list[str]) -> None:
    """Run one of llama.cpp's tools; a failure is one line with its last line and the command (as `shown`, with
    the final paths rather than the temporary ones)."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise UsafError(
            f"llama.cpp's {tool} failed ({last[-1].strip() if last else f'exit {done.returncode}'}); the "
            f"command was: {' '.join(shown)}"
        )


def _sixteen_bits(merged_dir: Path) -> str:
    """The 16-bit type a quantization starts from: bf16 for a bf16 model (its own values), else f16."""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((merged_dir / "config.json").read_text())
        if "bfloat16" in (str(config.get("dtype")), str(config.get("torch_dtype"))):
            return "bf16"
    return "f16"


def convert(
    merged_dir: Path, out: Path, outtype: str, converter: Path, name: str, quantize: Path | None = None
) -> Path:
    """Run the converter (then `quantize` for its types) on `merged_dir`, `name` as the GGUF's general.name; the
    GGUF appears at `out` only when every step succeeded and it is one (a 16-bit intermediate is removed)."""
    check_outtype(outtype)
    if outtype in QUANTIZE_OUTTYPES and quantize is None:
        raise UsafError(f"--outtype {outtype} needs llama.cpp's {QUANTIZE}: {QUANTIZE_HINT}.")
    converting = outtype if outtype in CONVERTER_OUTTYPES else _sixteen_bits(merged_dir)
    command = [sys.executable, str(converter), str(merged_dir), "--outtype", converting, "--model-name", name]

    def write(tmp: Path) -> None:
        if outtype in CONVERTER_OUTTYPES:
            _run([*command, "--outfile", str(tmp)], "converter", [*command, "--outfile", str(out)])
        else:
            intermediate = temporary_name(out)
            try:
                _run(
                    [*command, "--outfile", str(intermediate)],
                    "converter",
                    [*command, "--outfile", "F16.gguf"],
                )
                quantizing = [str(quantize), str(intermediate), str(tmp), outtype.upper()]
                _run(quantizing, QUANTIZE, [str(quantize), "F16.gguf", str(out), outtype.upper()])
            finally:
                with contextlib.suppress(FileNotFoundError):
                    intermediate.unlink()
        if not GGUF.is_one(tmp):
            raise UsafError(f"llama.cpp's converter ({converter}) wrote no GGUF file; nothing was written.")

    atomic_file(out, write)
    return out
