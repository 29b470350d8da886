"""Every mistake is one line, argparse's own too; ``policy --help`` lists what ``--topology``, ``--model`` and
``--workload`` accept and a topology file's fields, read from the named machines the lab writes
(:mod:`dlo_fn.cost.topology_file`)."""

from __future__ import annotations

import pytest

from dlo_fn.cli import build_parser, main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["polcy"], ["dlo_fn: error: ", "invalid choice: 'polcy'"]),
        (
            ["policy", "--slotz", "2"],
            ["dlo_fn policy: error: unrecognized arguments: --slotz 2", "python -m dlo_fn policy --help"],
        ),
        (["policy", "--objective", "speed"], ["dlo_fn policy: error: ", "invalid choice: 'speed'"]),
        (["make-checkpoint"], ["dlo_fn make-checkpoint: error: ", "required: --model, --out"]),
    ],
)
def test_argparse_mistakes_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_policy_help_names_topologies_models_workloads_and_the_file_fields(capsys):
    from dlo_fn.cost import topology_file as topologies

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["policy", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    topo = out.split("named topologies (--topology NAME):")[1]
    assert all(f"\n  {name} " in topo for name in topologies.topology_names())
    assert all(name in out for name in topologies.model_names())
    assert all(repr(name) in out for name in topologies.workloads())
    fields = out.split("a topology file (--topology FILE.json) is one JSON object:")[1]
    for field, required, _ in topologies.TOPOLOGY_FILE_FIELDS:
        assert f"\n  {field} " in fields and (" required " if required else " optional ") in fields


def test_the_file_fields_are_what_topology_from_dict_reads():
    from dlo_fn.cost import topology_file as topologies

    written = topologies.topology_to_dict(topologies.topology("1xH200"))
    assert set(written) == {f for f, _, _ in topologies.TOPOLOGY_FILE_FIELDS}
    required = {f: written[f] for f, req, _ in topologies.TOPOLOGY_FILE_FIELDS if req}
    assert topologies.topology_from_dict(required).name == "1xH200"
    with pytest.raises(ValueError, match="missing field"):
        topologies.topology_from_dict({k: v for k, v in required.items() if k != "compute"})


def test_the_lab_says_its_mistakes_in_one_line_with_its_own_name(capsys):
    from benchmarks.cli import main as lab_main

    with pytest.raises(SystemExit) as exc:
        lab_main(["bench", "step", "--bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err == [
        "benchmarks bench step: error: unrecognized arguments: --bogus (see python -m benchmarks bench step --help)"
    ], err
