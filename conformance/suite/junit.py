"""JUnit XML for CI systems: `mha check --junit FILE`, `mha verify --junit FILE`.

The widely read form (Jenkins, GitLab, GitHub test reporters, pytest's own
--junitxml): <testsuites><testsuite><testcase classname name time> with a
<failure>, <error> or <skipped> child where the case did not pass. A
failure's text is the message the terminal shows for that case; an
unsupported case is <skipped> with its reason (not a pass); a vector
verified on the forward pass only passes, with that said in <system-out>.
Written atomically (weights.atomic): the file is the old one or the new one.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import socket
import xml.etree.ElementTree as ET

from conformance.suite.compare import DEFAULT_PATH
from weights.atomic import write_bytes_atomic

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"

# Characters XML 1.0 cannot hold, even escaped (a NUL in an exception message, say).
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclasses.dataclass
class JUnitCase:
    classname: str
    name: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""  # the full text: a failure's or error's report, a skip's reason
    seconds: float = 0.0
    output: str = ""  # <system-out>: what a passing case wants said (forward only ...)


def _clean(text: str) -> str:
    return _NOT_XML.sub("?", str(text))


def to_xml(suite: str, cases: list[JUnitCase], *, seconds: float, properties: dict[str, str] | None = None) -> bytes:
    counts = {outcome: sum(c.outcome == outcome for c in cases) for outcome in (FAILED, ERROR, SKIPPED)}
    totals = {"tests": str(len(cases)), "failures": str(counts[FAILED]), "errors": str(counts[ERROR]),
              "skipped": str(counts[SKIPPED]), "time": f"{seconds:.3f}"}
    root = ET.Element("testsuites", {"name": _clean(suite), **totals})
    node = ET.SubElement(root, "testsuite", {
        "name": _clean(suite), **totals,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": _clean(socket.gethostname()),
    })
    if properties:
        props = ET.SubElement(node, "properties")
        for key, value in properties.items():
            ET.SubElement(props, "property", {"name": _clean(key), "value": _clean(value)})
    for case in cases:
        element = ET.SubElement(node, "testcase", {"classname": _clean(case.classname), "name": _clean(case.name),
                                                   "time": f"{case.seconds:.4f}"})
        if case.outcome in (FAILED, ERROR, SKIPPED):
            tag = {FAILED: "failure", ERROR: "error", SKIPPED: "skipped"}[case.outcome]
            first_line = case.message.splitlines()[0] if case.message else case.outcome
            child = ET.SubElement(element, tag, {"message": _clean(first_line)})
            child.text = _clean(case.message)
        elif case.outcome != PASSED:
            raise ValueError(f"outcome must be one of {PASSED}, {FAILED}, {ERROR}, {SKIPPED}: got {case.outcome!r}")
        if case.output:
            ET.SubElement(element, "system-out").text = _clean(case.output)
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def write(path, suite: str, cases: list[JUnitCase], *, seconds: float, properties: dict[str, str] | None = None) -> None:
    write_bytes_atomic(path, to_xml(suite, cases, seconds=seconds, properties=properties), overwrite=True)


# -- mha verify -------------------------------------------------------------------------

def verify_cases(results) -> list[JUnitCase]:
    """One testcase per vector (conformance.suite.verify.VerifyResult)."""
    outcome = {"pass": PASSED, "fail": FAILED, "error": ERROR, "unsupported": SKIPPED}
    cases = []
    for r in results:
        message = "" if r.status == "pass" else r.message()
        if r.status == "error" and r.traceback:
            message += "\n\n" + r.traceback
        if r.status == "unsupported":
            message = f"unsupported: {r.detail}"
        cases.append(JUnitCase("mha.verify", r.name, outcome[r.status], message, r.seconds,
                              output=r.message() if r.status == "pass" else ""))
        cases += not_judged_cases("mha.verify", r.name, [c for c in r.comparisons if c.ok and not c.judged])
    return cases


def write_verify(path, results, *, impl: str, seconds: float) -> None:
    write(path, f"mha verify {impl}", verify_cases(results), seconds=seconds, properties={"impl": impl})


# -- mha check --------------------------------------------------------------------------

def check_message(r) -> str:
    """A check result (conformance.suite.compare.CaseResult) as the report says it:
    each failing quantity (worst element, both values, margin, tolerance and
    reason), the first divergent stage, the backend's message."""
    path = "" if r.path == DEFAULT_PATH else f"/{r.path}"
    lines = [f"{r.status} {r.case}.{r.dtype} on {r.backend}{path}/{r.device} ({r.precision})"]
    failing = [c for c in r.comparisons if not c.ok]
    shown = failing or ([r.worst] if r.worst is not None else [])
    lines += [f"  {c.describe()}" for c in shown]
    if r.divergence is not None:
        lines.append(f"  {r.divergence.describe()}")
    if r.message:
        lines.append(f"  {r.message}")
    return "\n".join(lines)


def check_cases(results) -> list[JUnitCase]:
    """One testcase per case x backend x path x device x dtype (classname mha.check.BACKEND[.PATH].DEVICE)."""
    outcome = {"pass": PASSED, "fail": FAILED, "error": ERROR, "unsupported": SKIPPED}
    cases = []
    for r in results:
        text = check_message(r)
        if r.status == "error" and r.arrays.get("traceback"):
            text += "\n\n" + r.arrays["traceback"]
        passed = r.status == "pass"
        path = "" if r.path == DEFAULT_PATH else f".{r.path}"
        cases.append(JUnitCase(f"mha.check.{r.backend}{path}.{r.device}", f"{r.case}.{r.dtype}", outcome[r.status],
                              "" if passed else text, r.seconds, output=text if passed else ""))
        cases += not_judged_cases(f"mha.check.{r.backend}{path}.{r.device}", f"{r.case}.{r.dtype}", r.not_judged)
    return cases


def not_judged_cases(classname: str, name: str, comparisons) -> list[JUnitCase]:
    """One <skipped> testcase per comparison that is no check (its allowance is not well below the quantity's
    size: conformance.suite.tolerance.not_judged_reason), named after its quantity: never counted a pass."""
    return [JUnitCase(classname, f"{name} {c.name}", SKIPPED, f"{c.not_judged}; {c.describe()}") for c in comparisons]


def write_check(path, results, *, seconds: float, skipped=()) -> None:
    """skipped: check.plan's (backend, device, reason) for what did not run (a
    framework not installed, a device not present): one <skipped> testcase
    each, so a report that lacks a backend says why instead of looking green."""
    cases = check_cases(results)
    cases += [JUnitCase(f"mha.check.{backend}.{device}", "not run", SKIPPED, reason) for backend, device, reason in skipped]
    write(path, "mha check", cases, seconds=seconds)
