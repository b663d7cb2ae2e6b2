"""What `lagscope analyze` loads to start: the analysis of a small trace takes less time
than importing a validation framework or a general yaml parser, so none is on its path
(the whole-process times against the reference analyzer are in `make bench`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.producers.reference_format import flat_yaml_mapping, load_meta


def test_analyze_imports_no_validation_framework_no_yaml_no_remote_filesystems(
    reference_dir: Path, tmp_path: Path
) -> None:
    script = textwrap.dedent(
        """
        import sys
        from lagscope.cli import main
        sys.argv = ["lagscope", "analyze", "--trace", sys.argv[1], "--meta", sys.argv[2],
                    "--json", sys.argv[3]]
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        roots = {name.split(".")[0] for name in sys.modules}
        print(sorted(roots & {"pydantic", "yaml", "pandas", "matplotlib", "jinja2"}),
              "pyarrow.fs" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(reference_dir / "trace-ST.parquet"),
         str(reference_dir / "meta-ST.yaml"), str(tmp_path / "st.json")],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[] False", done.stdout + done.stderr
    assert (tmp_path / "st.json").stat().st_size > 0


_SPECIAL = ["010", "0x1f", "1e5", "1.5", "~", "null", "Yes", "off", "TRUE", "on", "NO", "Null"]
_KEYS = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), st.sampled_from(_SPECIAL)
)
_VALUES = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.sampled_from(_SPECIAL),
    st.from_regex(r"[A-Za-z][A-Za-z0-9_.:#-]{0,6}", fullmatch=True),
)


@settings(max_examples=500)
@given(st.lists(st.tuples(_KEYS, _VALUES), min_size=1, max_size=6))
def test_the_flat_meta_reader_reads_what_yaml_reads_or_leaves_it_to_yaml(
    lines: list[tuple[str, str]],
) -> None:
    text = "".join(f"{key}: {value}\n" for key, value in lines)
    fast = flat_yaml_mapping(text)
    if fast is not None:
        assert fast == yaml.safe_load(text), text


def test_a_meta_file_yaml_must_read_still_loads(tmp_path: Path) -> None:
    meta = tmp_path / "meta.yaml"
    meta.write_text("# written by hand\ntrial_name: 'my job'\ndp_size: 2\npp_size: 1\n"
                    "world_size: 2\nmodel_flops_per_step: 1.5e+15\n")  # fmt: skip
    loaded = load_meta(meta)
    assert (loaded.trial_name, loaded.world_size, loaded.model_flops_per_step) == (
        "my job",
        2,
        1.5e15,
    )
