"""Fleet editing in the UI: forms over the REST API's serializers (fleet.api.serializers), so a
form saves through the same services and fails with the same errors as the API.

The Django form only draws the fields (widgets, choices, the values typed); validation and the
save are the serializer's, and its errors are put on the form's fields. Operators only: a
viewer gets 403 on these pages, GET or POST; anonymous users go to the login page.
"""

from __future__ import annotations

from dataclasses import dataclass

from django import forms
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.exceptions import PermissionDenied
from django.db import models
from django.forms.utils import ErrorDict
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse, reverse_lazy
from django.views import View

from base.permissions import user_is_operator
from fleet.api import serializers as s
from fleet.models import Datacenter, GPUType, Instance, Node, UnitPrice, WANLink


@dataclass(frozen=True)
class Kind:
    slug: str
    model: type[models.Model]
    serializer: type
    singular: str
    plural: str


KINDS = {
    k.slug: k
    for k in (
        Kind("datacenters", Datacenter, s.DatacenterSerializer, "datacenter", "Datacenters"),
        Kind("gpu-types", GPUType, s.GPUTypeSerializer, "GPU type", "GPU types"),
        Kind("unit-prices", UnitPrice, s.UnitPriceSerializer, "unit price", "Unit prices"),
        Kind("links", WANLink, s.WANLinkSerializer, "WAN link", "WAN links"),
        Kind("nodes", Node, s.NodeSerializer, "node", "Nodes"),
        Kind("instances", Instance, s.InstanceSerializer, "instance", "Instances"),
    )
}


def kind_of(slug: str) -> Kind:
    try:
        return KINDS[slug]
    except KeyError:
        raise Http404(f"no such fleet object kind: {slug}") from None


def writable_fields(kind: Kind) -> list[str]:
    """The serializer's writable fields: what the API lets a client set."""
    return [name for name, f in kind.serializer().fields.items() if not f.read_only]


def form_class(kind: Kind) -> type[forms.ModelForm]:
    widgets: dict[str, forms.Widget | type[forms.Widget]] = {}
    for field in kind.model._meta.get_fields():
        if getattr(field, "get_internal_type", lambda: "")() == "TextField":
            widgets[field.name] = forms.Textarea(attrs={"rows": 3})
    return forms.modelform_factory(
        kind.model, fields=writable_fields(kind), widgets=widgets, formfield_callback=_formfield
    )


def _formfield(field, **kwargs):
    # The form only draws the field; the serializer checks URLs (fleet.endpoints).
    if isinstance(field, models.URLField):
        kwargs.setdefault("assume_scheme", "http")
    return field.formfield(**kwargs)


def form_with_errors(kind: Kind, data, instance, errors: dict) -> forms.ModelForm:
    """A form showing `data` with the serializer's `errors` on its fields (its own validation
    never runs: the serializer's is the one that counts)."""
    form = form_class(kind)(data=data, instance=instance)
    # Errors given without running the form's clean(); django-stubs leave out BaseForm's
    # private _errors (where full_clean() puts them, and add_error() adds to them).
    form._errors = ErrorDict()  # type: ignore[attr-defined]
    form.cleaned_data = {}
    for field, messages_ in errors.items():
        target = field if field in form.fields else None
        if target is None and field not in ("non_field_errors", "detail"):
            messages_ = [f"{field}: {m}" for m in messages_]
        form.add_error(target, [str(m) for m in messages_])
    return form


def api_errors(exc_detail) -> dict[str, list[str]]:
    if isinstance(exc_detail, dict):
        out = {}
        for k, v in exc_detail.items():
            out[k] = [str(x) for x in v] if isinstance(v, list) else [str(v)]
        return out
    return {"non_field_errors": [str(x) for x in exc_detail]}


class OperatorRequiredMixin(LoginRequiredMixin):
    """Logged-in operators only: anonymous users go to the login page, others get 403
    saying ``refused``."""

    login_url = reverse_lazy("frontend:login")
    refused = "Only operators may change the fleet; viewers read it."

    def dispatch(self, request, *args, **kwargs):
        if request.user.is_authenticated and not user_is_operator(request.user):
            raise PermissionDenied(self.refused)
        return super().dispatch(request, *args, **kwargs)


class FleetEditView(OperatorRequiredMixin, View):
    """Add (no pk) or edit (pk) one datacenter, GPU type, unit price, WAN link, node or
    instance."""

    template_name = "frontend/fleet_form.html"

    def _object(self, kind: Kind, pk):
        return get_object_or_404(kind.model, pk=pk) if pk is not None else None

    def _render(self, request, kind, obj, form, status=200, **extra):
        ctx = {
            "kind": kind,
            "obj": obj,
            "form": form,
            "section": "fleet",
            "is_operator": True,
            **extra,
        }
        return render(request, self.template_name, ctx, status=status)

    def get(self, request, kind: str, pk: int | None = None):
        k = kind_of(kind)
        obj = self._object(k, pk)
        initial = {}
        if obj is None:
            # ?from=<dc id> etc. prefill a new object's fields (links from the fleet page)
            initial = {f: request.GET[f] for f in writable_fields(k) if f in request.GET}
        return self._render(request, k, obj, form_class(k)(instance=obj, initial=initial))

    def post(self, request, kind: str, pk: int | None = None):
        k = kind_of(kind)
        obj = self._object(k, pk)
        serializer = k.serializer(instance=obj, data=request.POST, context={"request": request})
        if not serializer.is_valid():
            form = form_with_errors(k, request.POST, obj, api_errors(serializer.errors))
            return self._render(request, k, obj, form, status=400)
        try:
            saved = serializer.save()
        except Exception as exc:  # the services' ValidationErrors, as the API reports them
            from rest_framework.exceptions import ValidationError

            if not isinstance(exc, ValidationError):
                raise
            form = form_with_errors(k, request.POST, obj, api_errors(exc.detail))
            return self._render(request, k, obj, form, status=400)
        token = getattr(saved, "_agent_token", None)
        if token:
            # A new node's agent token is shown once, on this page only (never in a message
            # or a redirect, which would store it in the session).
            return self._render(request, k, saved, None, status=201, agent_token=token)
        verb = "updated" if obj is not None else "added"
        messages.success(request, f"{k.singular[:1].upper()}{k.singular[1:]} {saved} {verb}.")
        return HttpResponseRedirect(reverse("frontend:fleet-config") + f"#{k.slug}")


class FleetConfigView(LoginRequiredMixin, View):
    """The fleet's configuration for everyone logged in; operators get add and edit links."""

    login_url = reverse_lazy("frontend:login")

    def get(self, request):
        ctx = {
            "section": "fleet",
            "is_operator": user_is_operator(request.user),
            "kinds": KINDS,
            "datacenters": Datacenter.objects.all(),
            "gpu_types": GPUType.objects.all(),
            "unit_prices": UnitPrice.objects.select_related("gpu_type", "datacenter"),
            "links": WANLink.objects.select_related("from_datacenter", "to_datacenter"),
            "nodes": Node.objects.select_related("datacenter", "gpu_type").prefetch_related(
                "instances"
            ),
            "instances": Instance.objects.select_related(
                "node", "node__datacenter", "served_model"
            ).order_by("id"),
        }
        return render(request, "frontend/fleet_config.html", ctx)
