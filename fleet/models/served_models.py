"""Served models: what engines load, and the KV size per token that routing must ship."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from fleet.validators import GreaterThanValidator, slug_name
from pdd.profiles import is_profile_source, load_profile


class ServedModel(models.Model):
    name = models.CharField(
        max_length=128,
        unique=True,
        validators=[slug_name],
        help_text="Model name clients ask for, e.g. 'baton-tiny'.",
    )
    source = models.CharField(
        max_length=512,
        help_text=(
            "What an engine loads: 'baton-tiny' (built in), a local folder holding a Hugging "
            "Face-layout checkpoint (config.json + *.safetensors + tokenizer.json), or "
            "'profile:<name or .json path>': a model profile run by the EMULATED engine "
            "(modelled step times on the instance's GPU type, no weights)."
        ),
    )
    tokenizer = models.CharField(
        max_length=512,
        blank=True,
        help_text="Tokenizer to use; empty means the checkpoint's own (or bytes for baton-tiny).",
    )
    dtype = models.CharField(
        max_length=16,
        default="float32",
        choices=[("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")],
        help_text="Weight and KV dtype the engine runs in.",
    )
    num_layers = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="Transformer layers.",
    )
    kv_bytes_per_token = models.PositiveIntegerField(
        validators=[GreaterThanValidator(0), MaxValueValidator(100_000_000)],
        help_text="Bytes of KV cache per token across all layers; sizes WAN transfers.",
    )
    max_context_tokens = models.PositiveIntegerField(
        default=4096,
        validators=[MinValueValidator(1), MaxValueValidator(10_000_000)],
        help_text="Longest prompt + output the engine accepts, tokens.",
    )
    kv_block_size = models.PositiveIntegerField(
        default=16,
        validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="Tokens per KV-cache block (the unit of prefix caching and transfer).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "served model"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kv_bytes_per_token__gt=0),
                name="servedmodel_kv_bytes_gt0",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def emulated(self) -> bool:
        """Served by the emulated engine (a model profile), not a real model."""
        return is_profile_source(self.source)

    def clean(self) -> None:
        super().clean()
        if not self.emulated:
            return
        try:
            profile = load_profile(self.source)
        except ValueError as exc:
            raise ValidationError({"source": str(exc)}) from None
        per_token = profile.model.kv_bytes_per_token
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token != per_token:
            raise ValidationError(
                {
                    "kv_bytes_per_token": (
                        f"must be {per_token}, the KV per token of profile {profile.name}"
                    )
                }
            )
