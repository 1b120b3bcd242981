"""`jaxinfer bench` itself: output paths are checked before a workload runs (a bad one costs no minutes of
measuring), an unknown workload is a usage error, and no help text cites the project's tracker."""

from __future__ import annotations

import re

import pytest

from jaxinfer.benchmarks import WORKLOADS
from jaxinfer.benchmarks.cli import workload_parser
from jaxinfer.cli import main


@pytest.mark.parametrize(("option", "path", "message"), [
    ("--write", "{tmp}/missing/B.md", "does not exist"),
    ("--json", "{tmp}", "is a folder"),
])
def test_unwritable_output_paths_are_refused_before_the_run(tmp_path, capsys, option, path, message):
    status = main(["bench", "attention", option, path.format(tmp=tmp_path), "--reps", "1"])
    err = capsys.readouterr().err
    assert status == 2 and option in err and message in err
    assert "Traceback" not in err


def test_unknown_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "nonsense"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("name", WORKLOADS)
def test_help_texts_cite_no_tracker_issues(name):
    """Found by a fresh-user trial: `bench quality --help` cited "(issue 9)", a reference users cannot follow."""
    parser, _ = workload_parser(name)
    text = parser.format_help()
    assert not re.search(r"\bissue\b", text, re.IGNORECASE), re.findall(r".*\bissue\b.*", text, re.IGNORECASE)


@pytest.mark.parametrize("text, kwargs, expected", [
    ("1,8", {}, [1, 8]), (" 2, 3 ", {}, [2, 3]), ("", {"allow_empty": True}, []), ("4", {"lo": 2, "hi": 4}, [4]),
])
def test_int_lists_parse(text, kwargs, expected):
    from jaxinfer.benchmarks.report import int_list

    assert int_list("--opt", text, **kwargs) == expected


@pytest.mark.parametrize("text, kwargs, message", [
    ("1,,2", {}, "--opt '1,,2': expected comma-separated integers >= 1"),  # an empty item is no integer
    ("", {}, "--opt '': expected comma-separated integers >= 1"),
    ("1,x", {}, "--opt '1,x'"), ("0", {}, "--opt '0'"), ("5", {"lo": 2, "hi": 4}, "integers in [2, 4]"),
    ("1,", {}, "--opt '1,'"),
])
def test_int_lists_name_what_is_wrong(text, kwargs, message):
    from jaxinfer.benchmarks.report import int_list

    with pytest.raises(ValueError, match=re.escape(message)):
        int_list("--opt", text, **kwargs)


def test_name_lists_keep_order_drop_repeats_and_refuse_empty_items():
    from jaxinfer.benchmarks.report import name_list

    assert name_list("--opt", " b ;a;b", ";") == ["b", "a"]
    assert name_list("--opt", "Q4_0") == ["Q4_0"]
    for text, sep, message in (("a;;b", ";", "--opt 'a;;b': an empty item; expected ';'-separated names"),
                               ("a,", ",", "--opt 'a,': an empty item"), (" ", ",", "--opt ' ': an empty list")):
        with pytest.raises(ValueError, match=re.escape(message)):
            name_list("--opt", text, sep)
