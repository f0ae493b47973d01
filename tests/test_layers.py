"""The package's rooms stay in order (tools/import_graph.py): no module imports a room above or beside its own,
so no circle of imports crosses rooms, and the package never imports the developer tools."""
from __future__ import annotations

from pathlib import Path

from tools.import_graph import PACKAGE, RANKS, circles, edges, room, violations


def test_the_package_keeps_its_rooms_in_order():
    assert violations() == []


def test_no_circle_crosses_rooms():
    for members in circles(edges()):
        assert len({room(m) for m in members}) == 1, members


def test_every_room_has_a_place():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert rooms <= set(RANKS), rooms - set(RANKS)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pyinfer"


def test_the_check_finds_what_breaks_the_order(tmp_path):
    # an upward import inside a function, one beside (formats -> native), a dispatch by string, a tools import,
    # and a room without a rank; lawful imports of lower rooms and of the root's base modules pass
    package = _write(tmp_path, {
        "pyinfer/__init__.py": "",
        "pyinfer/errors.py": "",
        "pyinfer/formats/__init__.py": "",
        "pyinfer/formats/reader.py": "def f():\n    from pyinfer.engine import driver\n",
        "pyinfer/formats/both.py": "from pyinfer.native.ggml import Tensor\nfrom pyinfer.errors import X\n",
        "pyinfer/native/__init__.py": "",
        "pyinfer/native/ggml.py": "from pyinfer import errors\n",
        "pyinfer/engine/__init__.py": "",
        "pyinfer/engine/driver.py": "from pyinfer.formats import reader\nNAME = 'pyinfer.apps.cli'\n",
        "pyinfer/engine/bench.py": "import tools.bench\n",
        "pyinfer/apps/__init__.py": "",
        "pyinfer/apps/cli.py": "from pyinfer.engine.driver import NAME\n",
        "pyinfer/attic/__init__.py": "",
        "tools/__init__.py": "",
        "tools/bench.py": "",
    })
    found = violations(package)
    assert found == [
        "pyinfer.attic: room 'attic' has no place in RANKS",
        "pyinfer.engine.bench imports tools.bench: the package never imports the developer tools",
        "pyinfer.engine.driver (engine) imports pyinfer.apps.cli (apps): not a lower room",
        "pyinfer.formats.both (formats) imports pyinfer.native.ggml (native): not a lower room",
        "pyinfer.formats.reader (formats) imports pyinfer.engine.driver (engine): not a lower room",
    ], found
    # driver -> reader -> driver and driver -> cli -> driver: one circle of three modules in three rooms
    assert circles(edges(package)) == [["pyinfer.apps.cli", "pyinfer.engine.driver", "pyinfer.formats.reader"]]
