"""Field validators shared by fleet models."""

from __future__ import annotations

from django.core.validators import BaseValidator, RegexValidator
from django.utils.deconstruct import deconstructible


@deconstructible
class GreaterThanValidator(BaseValidator):
    """A strictly-positive style check; MinValueValidator would accept the limit itself."""

    message = "Ensure this value is greater than %(limit_value)s."
    code = "min_value"

    def compare(self, a, b) -> bool:
        return a <= b


slug_name = RegexValidator(
    regex=r"^[a-z0-9][a-z0-9._-]*$",
    message="Use lowercase letters, digits, '.', '_' or '-', starting with a letter or digit.",
)

hostname = RegexValidator(
    regex=(
        r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
    ),
    message="Enter a valid hostname (letters, digits, '-' and '.').",
)
