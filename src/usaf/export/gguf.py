"""A merged export converted to GGUF (llama.cpp, Ollama, LM Studio) by llama.cpp's own converter.

usaf does not reimplement `convert_hf_to_gguf.py`: llama.cpp keeps its tensor names, tokenizer handling and
quantization types up to date, and a merged export is a plain Hugging Face checkpoint it already reads. usaf finds
the converter, runs it on the merged folder with the interpreter usaf runs in, and puts the file in place only
once the converter has finished.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from usaf.errors import ConfigError, UsafError
from usaf.io.atomic import atomic_file
from usaf.io.guard import GGUF

CONVERTER = "convert_hf_to_gguf.py"
OUTTYPES = ("f16", "bf16", "q8_0", "f32")
ENVIRONMENT = "LLAMA_CPP"
INSTALL_HINT = (
    "get llama.cpp (git clone https://github.com/ggml-org/llama.cpp, then pip install -r "
    "llama.cpp/requirements/requirements-convert_hf_to_gguf.txt) and pass --llama-cpp DIR or set LLAMA_CPP=DIR"
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


def convert(merged_dir: Path, out: Path, outtype: str, converter: Path) -> Path:
    """Run the converter on `merged_dir`; the GGUF appears at `out` only when it succeeded and is one."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}.")
    command = [sys.executable, str(converter), str(merged_dir), "--outtype", outtype]

    def write(tmp: Path) -> None:
        done = subprocess.run([*command, "--outfile", str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            last = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            raise UsafError(
                f"llama.cpp's converter failed ({last[-1].strip() if last else f'exit {done.returncode}'}); the "
                f"command was: {' '.join(command)} --outfile {out}"
            )
        if not GGUF.is_one(tmp):
            raise UsafError(f"llama.cpp's converter ({converter}) wrote no GGUF file; nothing was written.")

    atomic_file(out, write)
    return out
