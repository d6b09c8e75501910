"""The parse registry of format families: every family's names read back, the error of an
unknown spec lists every family's grammar, and a family added from outside (one module) is read
by parse_format, passed through and described, with nothing else edited."""

import subprocess
import sys
import textwrap

import pytest

from lowprec.numerics.formats import NAMED_FORMATS, describe, families, parse_format

FAMILIES = families()


def test_the_five_families_in_parse_order():
    assert [f.name for f in FAMILIES] == ["float", "fixed", "block", "dynamic_fixed", "binary"]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_name_reads_back_to_its_family(family):
    for name, fmt in {**family.names, **family.aliases}.items():
        assert isinstance(fmt, family.types)
        assert parse_format(name) == fmt and parse_format(name.upper()) == fmt
        assert parse_format(str(fmt)) == fmt
        assert parse_format(fmt) is fmt
        assert describe(fmt)["format"] == str(fmt)


def test_named_formats_are_the_families_names_in_order():
    assert list(NAMED_FORMATS) == [n for f in FAMILIES for n in f.names]


def test_an_unknown_spec_lists_every_grammar():
    with pytest.raises(ValueError) as err:
        parse_format("e4m3x")
    msg = str(err.value)
    assert msg.startswith("unknown number format 'e4m3x'; accepted: ")
    assert msg.endswith("; ".join(f.accepted for f in FAMILIES))


def test_a_family_added_in_one_module_is_read_everywhere_parse_format_is():
    code = textwrap.dedent('''
        import re
        from dataclasses import dataclass
        from lowprec.numerics.formats import (FormatFamily, describe, parse_format,
                                              register_format_family)

        @dataclass(frozen=True)
        class LogFormat:
            dynamic = False
            max = min_normal = min_subnormal = eps = 1.0
            bits: int
            def __str__(self):
                return f"log<{self.bits}>"

        def parse(s, spec):
            m = re.match(r"^log<(\\d+)>$", s)
            return None if m is None else LogFormat(int(m.group(1)))

        register_format_family(FormatFamily("log", (LogFormat,), parse, accepted="log<N>",
                                            special=lambda f: "powers of two"))
        f = parse_format("LOG<4>")
        assert f == LogFormat(4) and parse_format(f) is f
        assert describe(f)["special"] == "powers of two" and describe(f)["bits"] == 4
        try:
            parse_format("log<x>")
        except ValueError as err:
            assert str(err).endswith("; binary; log<N>"), err
        print("ok")
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
