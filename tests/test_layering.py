"""indexer <- minimax_m3 <- eval: the indexer package imports nothing of ours but itself."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"indexer": set(), "minimax_m3": {"indexer"}, "eval": {"indexer", "minimax_m3"}}


def imported_top_level_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_packages_import_only_lower_layers():
    for package, allowed in LAYERS.items():
        for path in (ROOT / package).rglob("*.py"):
            for module in imported_top_level_modules(path):
                if module in LAYERS and module != package:
                    assert module in allowed, f"{path.relative_to(ROOT)} imports {module}"


def test_no_host_syncs_in_the_planner():
    source = (ROOT / "indexer" / "planner.py").read_text()
    for forbidden in (".item(", ".cpu(", ".tolist(", ".numpy(", "synchronize(", "nonzero("):
        assert forbidden not in source, forbidden


PUBLIC_INDEXER_MODULES = {"indexer", "indexer.contract", "indexer.wrapper", "indexer.cute_runtime",
                          "indexer.compile_check"}


def test_upper_layers_use_only_the_indexers_public_modules():
    """The model's kernels share the indexer's CuTe runtime module; nothing reaches into its backend or kernels."""
    for package in ("minimax_m3", "eval"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                for name in names:
                    if name.split(".")[0] == "indexer":
                        assert name in PUBLIC_INDEXER_MODULES, f"{path.relative_to(ROOT)} imports {name}"
