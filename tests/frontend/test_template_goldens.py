"""Every template × case in ../shared/templates/goldens.json renders byte-identically (or raises)."""

from __future__ import annotations

from datetime import datetime

import pytest

from flared.frontend import ChatTemplate

PINNED_NOW = datetime(2025, 1, 7, 13, 45, 9)


def _render(template: ChatTemplate, case: dict, goldens: dict, *, auto_marks: bool = False):
    conventions = goldens["conventions"]
    return template.render_traced(
        auto_marks=auto_marks,
        messages=case["messages"],
        tools=case.get("tools"),
        documents=case.get("documents"),
        add_generation_prompt=case["add_generation_prompt"],
        continue_final_message=case.get("continue_final_message", False),
        bos_token=conventions["bos_token"],
        eos_token=conventions["eos_token"],
        **case.get("template_kwargs", {}),
    )


def test_goldens(goldens, templates_dir):
    failures = []
    num_checked = 0
    num_auto_marked = 0
    for name, entry in sorted(goldens["templates"].items()):
        source = (templates_dir / name).read_bytes().decode("utf-8")
        template = ChatTemplate(source, clock=lambda: PINNED_NOW)
        assert template.sha256 == entry["sha256"], name
        num_auto_marked += template.has_auto_marks
        for case_id, expected in entry["results"].items():
            case = goldens["cases"][case_id]
            num_checked += 1
            if "error" in expected:
                try:
                    _render(template, case, goldens)
                except Exception:  # noqa: BLE001 - any raise is what the golden records
                    continue
                failures.append(f"{name} {case_id}: expected {expected['error']['type']}, rendered instead")
                continue
            try:
                rendered = _render(template, case, goldens)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{name} {case_id}: raised {type(exc).__name__}: {exc}")
                continue
            if rendered.text != expected["rendered"]:
                failures.append(f"{name} {case_id}: rendered text differs")
            elif _render(template, case, goldens, auto_marks=True).text != expected["rendered"]:
                failures.append(f"{name} {case_id}: the automatically marked copy renders differently")
            elif "generation_spans" in expected:
                if [list(s) for s in rendered.generation_spans] != expected["generation_spans"]:
                    failures.append(f"{name} {case_id}: generation spans {rendered.generation_spans}")
    assert num_checked == goldens["summary"]["cases"]
    assert num_auto_marked == len(goldens["templates"])  # every corpus template has a message loop
    assert not failures, "\n".join(failures[:40])


def test_errors_raise_the_recorded_type(goldens, templates_dir):
    """Errors raise the template's own exception family, as transformers does."""
    import jinja2

    families = {"TemplateError": jinja2.TemplateError, "UndefinedError": jinja2.UndefinedError,
                "TypeError": TypeError, "ValueError": ValueError, "SecurityError": jinja2.exceptions.SecurityError,
                "TemplateSyntaxError": jinja2.TemplateSyntaxError}
    checked = 0
    for name, entry in sorted(goldens["templates"].items()):
        template = ChatTemplate((templates_dir / name).read_bytes().decode("utf-8"), clock=lambda: PINNED_NOW)
        for case_id, expected in entry["results"].items():
            if "error" not in expected:
                continue
            family = families[expected["error"]["type"].rsplit(".", 1)[-1]]
            with pytest.raises(family):
                _render(template, goldens["cases"][case_id], goldens)
            checked += 1
    assert checked == goldens["summary"]["errors"]
