"""A nested Pydantic model with bounded strings and lists, as the openai SDK's `parse()` sends
one: structured outputs' integration test and benchmark ask for it alike."""

from pydantic import BaseModel, Field

ASK = "Describe a city you like: its name, three famous places and how big it is."


class Place(BaseModel):
    name: str = Field(max_length=24)
    kind: str = Field(max_length=12)


class City(BaseModel):
    name: str = Field(max_length=24)
    places: list[Place] = Field(max_length=3)
    size: int = Field(ge=0, le=100_000_000)
