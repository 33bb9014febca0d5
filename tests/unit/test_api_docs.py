"""Every public class and method of the client API (the list in tools/gen_api_docs.py, from
which docs/api.md is generated) and every error class has a docstring."""

from __future__ import annotations

import importlib.util
import inspect

from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("gen_api_docs", REPO_ROOT / "tools" / "gen_api_docs.py")
assert spec is not None and spec.loader is not None
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_every_public_class_and_method_has_a_docstring() -> None:
    missing = []
    for _, _, names in gen.API:
        for dotted in names:
            cls = gen.resolve(dotted)
            if not gen.doc_of(cls):
                missing.append(dotted)
            for name, member in gen.public_members(cls):
                if not gen.doc_of(member):
                    missing.append(f"{dotted}.{name}")
    assert missing == []


def test_every_error_has_a_docstring_and_the_reference_lists_it() -> None:
    errors = importlib.import_module(gen.ERRORS_MODULE)
    classes = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.KVPoolError)]
    assert len(classes) > 10 and all(gen.doc_of(c) for c in classes)
    text = gen.render()
    assert all(f"| `{c.__name__}` |" in text for c in classes) and "### `PoolAdmin`" in text
