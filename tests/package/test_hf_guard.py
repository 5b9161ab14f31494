"""The private transformers names usaf relies on are checked at import against pyproject.toml's range: a missing
one is said in one line (a warning at import, a ModelError where it is used), a version outside the range too."""

import re
import subprocess
import warnings
from pathlib import Path

import pytest
import transformers
from transformers.integrations.moe import ExpertsInterface
from transformers.utils import chat_template_utils

from usaf.errors import ModelError
from usaf.model import hf, hf_guard
from usaf.version import __version__

ROOT = Path(__file__).resolve().parents[2]


def pyproject_transformers_range() -> str:
    """The range as pyproject.toml writes it, e.g. '>=5.24,<6' (the one place it is declared)."""
    return re.search(r'"transformers([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def test_the_installed_versions_lack_nothing():
    """The suite's own transformers and torch (the newest of the range, or its lowest under `make test-lowest`)."""
    assert hf_guard.check() == {}
    assert hf_guard.in_range("transformers", transformers.__version__)


def test_the_range_is_pyproject_tomls():
    assert hf_guard.supported("transformers") == "transformers" + pyproject_transformers_range()


def test_a_missing_name_is_one_line_naming_the_versions(monkeypatch):
    monkeypatch.delattr(ExpertsInterface, "_global_mapping")
    monkeypatch.setitem(hf_guard.VERSIONS, "transformers", "5.30.0")
    wanted = "transformers" + pyproject_transformers_range()
    line = (
        f"usaf {__version__} supports {wanted}; found transformers 5.30.0 which lacks "
        f"ExpertsInterface._global_mapping: pip install '{wanted}'"
    )
    assert hf_guard.check() == {"_global_mapping": line}


def test_a_missing_name_warns_at_import_and_fails_where_it_is_used(monkeypatch):
    monkeypatch.delattr(chat_template_utils, "_compile_jinja_template")
    monkeypatch.setattr(hf_guard, "MISSING", hf_guard.check())
    assert list(hf_guard.MISSING) == ["_compile_jinja_template"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_guard.warn_at_import()
    assert [str(w.message) for w in caught] == list(hf_guard.MISSING.values())
    with pytest.raises(ModelError) as raised, hf.chat_template_compiler(lambda template: template):
        pass
    assert str(raised.value) == hf_guard.MISSING["_compile_jinja_template"]
    assert "\n" not in str(raised.value)
    hf.register_experts_implementation("usaf-guard-test", lambda *args: None)  # the names still there work
    assert "usaf-guard-test" in ExpertsInterface._global_mapping
    monkeypatch.delitem(ExpertsInterface._global_mapping, "usaf-guard-test")


def test_a_version_outside_the_range_is_said(monkeypatch):
    monkeypatch.setitem(hf_guard.VERSIONS, "transformers", "6.0.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_guard.warn_at_import()
    wanted = "transformers" + pyproject_transformers_range()
    assert [str(w.message) for w in caught] == [
        f"usaf {__version__} supports {wanted}; found transformers 6.0.0, outside that range (untested; if it "
        f"fails: pip install '{wanted}')"
    ]


def test_make_test_lowest_installs_the_ranges_lowest_version():
    """The Makefile reads the lowest version from pyproject.toml too (`make -n`: nothing runs)."""
    lowest = pyproject_transformers_range().split(",")[0].removeprefix(">=")
    dry = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), "test-lowest"], capture_output=True, text=True, check=True
    ).stdout
    assert f'"transformers=={lowest}"' in dry
