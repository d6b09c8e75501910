"""Shell completion of the ``lowprec`` command: the real values, without importing torch.

The console script (lowprec_cmd) answers argcomplete's request from the parser of lowprec.cli
built with the standard library and lowprec._names alone; the names there are copies of the
library's registries, compared here so that they cannot drift apart.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowprec
from lowprec import _names
from lowprec.experiments import config, data, models, planner
from lowprec.numerics import rounding
from lowprec.numerics.formats import NAMED_FORMATS
from lowprec.training import plan, policy

SRC = str(Path(__file__).resolve().parent.parent / "src")


def test_the_names_are_the_registries():
    assert _names.POLICY_NAMES == tuple(lowprec.POLICIES)
    assert _names.PRESET_NAMES == tuple(config.PRESETS)
    assert _names.DEFAULT_POLICIES == config.DEFAULT_POLICIES
    assert _names.DATASET_NAMES == tuple(data.DATASETS)
    assert _names.MODEL_NAMES == tuple(models.MODELS)
    assert _names.FORMAT_NAMES == tuple(NAMED_FORMATS)
    assert _names.PLAN_LEVELS == tuple(planner.LEVELS)
    assert _names.PLAN_PREFIX == plan.PLAN_PREFIX
    # every role of a compact spec has its short key here, and nothing else is a key
    keys = policy._KEYS
    assert set(_names.POLICY_KEYS) <= set(keys)
    assert {keys[k] for k in _names.POLICY_KEYS} == set(keys.values())
    assert len({keys[k] for k in _names.POLICY_KEYS}) == len(_names.POLICY_KEYS)
    for k in _names.POLICY_FORMAT_KEYS:  # each takes a format, any named one
        assert k in _names.POLICY_KEYS
        for f in _names.FORMAT_NAMES:
            policy.parse_policy(f"{k}={f}")
    # the long rounding names, each a mode of its own (srN is typed, not offered)
    modes = {rounding.parse_rounding(r)[0] for r in _names.ROUNDING_NAMES}
    assert len(modes) == len(_names.ROUNDING_NAMES) == len(rounding.Rounding) - 1
    # KIND:PATH datasets: the kinds load_dataset reads
    for kind in _names.DATASET_KINDS:
        assert f"{kind}:" in data._ACCEPTED or f"{kind}[:" in data._ACCEPTED, kind


def _complete(line: str, tmp_path) -> list[str]:
    """What the console script offers for ``line`` (the cursor at its end), with torch made
    unimportable in that process: completion must not need it."""
    result = tmp_path / "completions"
    result.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=SRC, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n",
               COMP_LINE=line, COMP_POINT=str(len(line)),
               _ARGCOMPLETE_STDOUT_FILENAME=str(result))
    code = ("import sys; sys.modules['torch'] = None; import lowprec_cmd; "
            "sys.exit(lowprec_cmd.main())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stderr[-2000:]
    # argcomplete ends a lone completion with a space (the word is done) and escapes what the
    # shell would read otherwise (dfx\<10\>)
    text = result.read_text()
    return [c.removesuffix(" ").replace("\\", "") for c in text.split("\n")] if text else []


def test_completion_offers_the_registries_without_torch(tmp_path):
    (tmp_path / "menus").mkdir()
    (tmp_path / "plan.json").write_text("{}")
    policies = _complete("lowprec compare --policies ", tmp_path)
    assert policies == [*_names.POLICY_NAMES, "plan:", *(k + "=" for k in _names.POLICY_KEYS)]
    assert "plan.json" not in policies
    # the next item of the list, a format after a format key, a plan file
    assert _complete("lowprec compare --policies 32-true,bf16-m", tmp_path) == [
        "32-true,bf16-mixed"]
    assert _complete("lowprec train --policy p=fp32,c=bf", tmp_path) == ["p=fp32,c=bf16"]
    # a comma inside <...> is part of a format; a quoted word comes back unescaped
    assert _complete("lowprec compare --policies 'q6.10-sr,p=fixed<16,1", tmp_path) == []
    assert _complete("lowprec compare --policies 'q6.10-sr,p=dfx<10>,c=mxfp8_e5",
                     tmp_path) == ["q6.10-sr,p=dfx<10>,c=mxfp8_e5m2"]
    assert _complete("lowprec compare --policies plan:p", tmp_path) == ["plan:plan.json"]
    assert _complete("lowprec compare --preset ", tmp_path) == list(_names.PRESET_NAMES)
    assert _complete("lowprec compare --data ", tmp_path) == [
        *_names.DATASET_NAMES, *(k + ":" for k in _names.DATASET_KINDS)]
    assert _complete("lowprec compare --data idx:me", tmp_path) == ["idx:menus/"]
    assert _complete("lowprec compare --model lenet5,", tmp_path) == [
        "lenet5," + m for m in _names.MODEL_NAMES]
    assert _complete("lowprec certify --model ", tmp_path) == list(_names.MODEL_NAMES)
    assert _complete("lowprec quantize 0.1 -f ", tmp_path) == list(_names.FORMAT_NAMES)
    assert _complete("lowprec quantize 0.1 -f fp16 -r sto", tmp_path) == ["stochastic"]
    assert _complete("lowprec plan --menu fp32,mx", tmp_path) == ["fp32,mxfp8", "fp32,mxfp4"]
    assert _complete("lowprec formats fp8_e4", tmp_path) == ["fp8_e4m3", "fp8_e4m3fnuz"]
    # flags still complete, from the same parser the command runs with
    assert "--policies" in _complete("lowprec compare --pol", tmp_path)
