"""StructuredOutputsParams validation (the interface shared with tool calling)."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint() -> None:
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(choice=("yes", "no")).choice == ["yes", "no"]
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"
    with pytest.raises(ValueError, match="structured_outputs must set exactly one.*none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    # JSON Schema's boolean schemas: true matches any value, false none
    assert StructuredOutputsParams(json=True).json == {}
    with pytest.raises(ValueError, match=r"^structured_outputs\.json is false: .*matches no value"):
        StructuredOutputsParams(json=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json": 3}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": 5}, "structured_outputs.grammar"),
        ({"regex": "a", "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern"),
    ],
)
def test_bad_field_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_field() -> None:
    assert SamplingParams().structured_outputs is None
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"})  # type: ignore[arg-type]
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.structured_outputs.regex == "[0-9]+"
    assert sp.clone().structured_outputs == sp.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs has unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), use_beam_search=True)
