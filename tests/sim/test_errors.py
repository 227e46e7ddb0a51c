from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sim.errors import KvsimConfigError, format_validation_error


class Engine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_seqs: int = Field(gt=0)
    block_size: int = 16


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: Engine
    model: Literal["Llama-3.1-8B", "Llama-3.1-70B"]
    turns: list[int] = []

    @model_validator(mode="after")
    def _check(self):
        if len(self.turns) > 2:
            raise ValueError(f"at most 2 turns, got {len(self.turns)}")
        return self


def validation_error(data):
    with pytest.raises(ValidationError) as info:
        Scenario.model_validate(data)
    return info.value


def test_names_path_value_and_message_in_one_line():
    exc = validation_error({"engine": {"max_num_seqs": -3}, "model": "foo"})
    text = format_validation_error(exc, "scenario.yaml")
    assert text.startswith(
        "scenario.yaml: engine.max_num_seqs = -3: Input should be greater than 0; "
    )
    assert "model = 'foo': Input should be 'Llama-3.1-8B' or 'Llama-3.1-70B'" in text
    assert "\n" not in text


def test_list_index_extra_key_and_missing_field():
    exc = validation_error({"engine": {"max_num_seqs": 1, "bogus": 2}, "turns": [1, "x"]})
    text = format_validation_error(exc, "--scenario")
    assert "engine.bogus = 2: Extra inputs are not permitted" in text
    assert "turns[1] = 'x': Input should be a valid integer" in text
    assert "model: Field required" in text
    assert "\n" not in text


def test_model_level_check_shows_its_message_without_prefix():
    exc = validation_error(
        {"engine": {"max_num_seqs": 1}, "model": "Llama-3.1-8B", "turns": [1, 2, 3]}
    )
    assert format_validation_error(exc, "s.yaml") == "s.yaml: at most 2 turns, got 3"


def test_long_inputs_are_truncated():
    exc = validation_error({"engine": {"max_num_seqs": "x" * 500}, "model": "Llama-3.1-8B"})
    text = format_validation_error(exc, "s.yaml")
    assert "..." in text
    assert len(text) < 200


def test_config_error_is_a_value_error():
    assert issubclass(KvsimConfigError, ValueError)


def test_short_repr_never_builds_the_whole_repr():
    from sim.errors import short_repr

    shared = ["x"] * 10
    for _ in range(30):  # 10**30 leaves if expanded
        shared = [shared] * 10
    text = short_repr(shared)
    assert len(text) <= 60 and text.startswith("[[")
    assert "..." in short_repr("y" * 10**7) and len(short_repr("y" * 10**7)) <= 60


def test_many_errors_are_capped():
    class Many(BaseModel):
        model_config = ConfigDict(extra="forbid")

    with pytest.raises(ValidationError) as info:
        Many.model_validate({f"k{i}": i for i in range(50)})
    text = format_validation_error(info.value, "s.yaml")
    assert text.count("Extra inputs are not permitted") == 6 and text.endswith("and 44 more")


class SectionChecked(BaseModel):
    engine: "SectionEngine"


class SectionEngine(Engine):
    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, data):
        if data.get("max_num_seqs") is True:
            raise ValueError("max_num_seqs = True: a number is needed")
        return data


def test_a_section_level_check_names_the_section_not_its_whole_input():
    # Its input is the whole section: the message names the field; the section is not dumped.
    with pytest.raises(ValidationError) as info:
        SectionChecked.model_validate({"engine": {"max_num_seqs": True, "block_size": 16}})
    text = format_validation_error(info.value, "s.yaml")
    assert text == "s.yaml: engine: max_num_seqs = True: a number is needed"
