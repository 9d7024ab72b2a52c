"""Settings for the Baton control plane, read from environment variables.

Embedded defaults (no variables set): a SQLite file under ``var/``, the in-memory channel layer
and Celery tasks executed in-process. ``DATABASE_URL`` and ``REDIS_URL`` switch to PostgreSQL
and Redis (Celery broker and the channels-redis layer).
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from base.env import (
    env_bool,
    env_float,
    env_int,
    env_int_list,
    env_list,
    env_str,
    generated_secret_key,
)
from pdd.dataplane import check_data_token

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("BATON_VAR_DIR", str(BASE_DIR / "var")))
# The gateway's admission journal, one file per process (routing/gateway/journal.py): a local
# disk of the gateway's host.
BATON_JOURNAL_DIR = Path(env_str("BATON_JOURNAL_DIR", str(VAR_DIR / "journal")))

DEBUG = env_bool("DEBUG", default=False)
# "development" (the default: the embedded demo, tests, a laptop) or "production": HTTPS-only
# cookies, HSTS, an HTTPS redirect, /metrics and the API schema closed to anonymous callers;
# `manage.py check --deploy` is clean there (docs/security.md, "Production profile").
BATON_PROFILE = env_str("BATON_PROFILE", "development").strip().lower()
if BATON_PROFILE not in ("development", "production"):
    raise ImproperlyConfigured(
        f"BATON_PROFILE={BATON_PROFILE!r}: use 'development' or 'production'"
    )
PRODUCTION = BATON_PROFILE == "production"
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DEBUG=true is not allowed with BATON_PROFILE=production")
# SECRET_KEY from the environment; else, outside DEBUG, one generated once into BATON_VAR_DIR
# (every process sharing that folder uses the same key); the fixed key only with DEBUG.
SECRET_KEY = env_str("SECRET_KEY", "") or (
    "baton-insecure-development-key-change-me-0123456789abcdef"
    if DEBUG
    else generated_secret_key(VAR_DIR / "secret_key")
)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "controlplane",
    "fleet",
    "billing",
    "routing",
    "plans",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.limits.BodyLimitMiddleware",
    "controlplane.security.ContentSecurityPolicyMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Security headers (docs/security.md). Always: no MIME sniffing, no framing, a strict CSP on
# every HTML page (scripts and styles from this origin only). In production also HTTPS only.
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
BATON_CSP = env_str(
    "BATON_CSP",
    "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'",
)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("BATON_SECURE_COOKIES", default=PRODUCTION)
SECURE_SSL_REDIRECT = env_bool("BATON_SSL_REDIRECT", default=PRODUCTION)
# Health probes may come over plain HTTP from inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SECURE_HSTS_SECONDS = env_int("BATON_HSTS_SECONDS", 31_536_000 if PRODUCTION else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = env_bool(
    "BATON_HSTS_PRELOAD", default=PRODUCTION
)
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto (only then: a client could send it).
if env_bool("BATON_TRUST_X_FORWARDED_PROTO", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# /metrics without BATON_METRICS_TOKEN: open in development, closed (401) in production.
BATON_METRICS_OPEN = env_bool("BATON_METRICS_OPEN", default=not PRODUCTION)

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Database: PostgreSQL (psycopg 3) in production, a SQLite file by default.
DATABASE_URL = env_str("DATABASE_URL", "")
# PostgreSQL connections come from a bounded pool per process (psycopg's pool, Django's
# OPTIONS["pool"]): a burst of requests waits up to BATON_DB_POOL_TIMEOUT_S for one of
# BATON_DB_POOL_MAX connections instead of opening one per thread until the server refuses
# ("too many clients already": 100 by default, shared by every web and worker process).
# BATON_DB_POOL_MIN stay open while idle (1: a Celery worker's child runs one task at a time).
# BATON_DB_POOL_MAX=0 turns the pool off (a persistent connection per thread, as before).
BATON_DB_POOL_MAX = env_int("BATON_DB_POOL_MAX", 20)
BATON_DB_POOL_MIN = env_int("BATON_DB_POOL_MIN", 1)
BATON_DB_POOL_TIMEOUT_S = env_float("BATON_DB_POOL_TIMEOUT_S", 10.0, minimum=0.1)
if BATON_DB_POOL_MAX < 0 or BATON_DB_POOL_MIN < 0 or 0 < BATON_DB_POOL_MAX < BATON_DB_POOL_MIN:
    raise ImproperlyConfigured(
        f"BATON_DB_POOL_MIN={BATON_DB_POOL_MIN} / BATON_DB_POOL_MAX={BATON_DB_POOL_MAX}: "
        "use 0 <= BATON_DB_POOL_MIN <= BATON_DB_POOL_MAX (BATON_DB_POOL_MAX=0: no pool)"
    )
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
    if BATON_DB_POOL_MAX and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # A pooled connection goes back to the pool when Django closes it, at the end of each
        # request: a pool needs CONN_MAX_AGE = 0 (Django refuses anything else).
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": BATON_DB_POOL_MIN,
            "max_size": BATON_DB_POOL_MAX,
            "timeout": BATON_DB_POOL_TIMEOUT_S,
        }
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "baton.sqlite3"),
            "OPTIONS": {
                "timeout": 20,
                # Several threads write (heartbeats, gateway records, sessions): take the write
                # lock at BEGIN, or a read-then-write transaction fails at once with "database
                # is locked" instead of waiting; WAL lets reads go on while one thread writes.
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
# Every API write is all-or-nothing: a request that fails half way saves nothing.
DATABASES["default"]["ATOMIC_REQUESTS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# uvicorn has no static file server; the ASGI entry serves them itself unless told not to.
SERVE_STATIC = env_bool("BATON_SERVE_STATIC", default=True)

LOGIN_URL = "/admin/login/"

# Untrusted input: the deepest JSON any endpoint parses, the largest request bodies (413
# beyond, in the caller's error shape) and how long a client may take to send one (408).
BATON_MAX_JSON_DEPTH = env_int("BATON_MAX_JSON_DEPTH", 64)
BATON_MAX_BODY_BYTES = env_int("BATON_MAX_BODY_BYTES", 4 * 1024 * 1024)  # /v1 (prompts)
BATON_MAX_API_BODY_BYTES = env_int("BATON_MAX_API_BODY_BYTES", 1024 * 1024)  # /api/v1
# Agents' reports: an MD's heartbeat lists its cached prefix blocks (~20 bytes each).
BATON_MAX_HEARTBEAT_BYTES = env_int("BATON_MAX_HEARTBEAT_BYTES", 4 * 1024 * 1024)
BATON_BODY_TIMEOUT_S = float(env_str("BATON_BODY_TIMEOUT_S", "15"))
# Django's own cap sits above ours, so ours answer first and in the right shape.
DATA_UPLOAD_MAX_MEMORY_SIZE = (
    max(BATON_MAX_BODY_BYTES, BATON_MAX_API_BODY_BYTES, BATON_MAX_HEARTBEAT_BYTES) + 1
)

# Redis: Celery broker and channel layer when set; otherwise in-process equivalents.
REDIS_URL = env_str("REDIS_URL", "")
# Namespace of the gateway's own Redis keys (rate-limit windows "<prefix>:rl:...", dispatch
# ledger "<prefix>:dispatch:..."): deployments, or test clusters, sharing one Redis keep apart.
REDIS_KEY_PREFIX = env_str("BATON_REDIS_PREFIX", "baton")

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": env_str("BATON_CHANNEL_PREFIX", "baton")},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# In-process broker without Redis; a hostname keeps kombu from warning that none was given.
CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
CELERY_RESULT_BACKEND = REDIS_URL or None
# Without a broker there is no worker: run tasks in the calling process.
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", default=not REDIS_URL)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_TASK_DEFAULT_QUEUE", "celery")
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 60)
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 90)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A task whose worker dies mid-run is delivered again: a child killed under the worker is
# rejected back to the queue, and with the whole worker gone Redis hands the unacknowledged
# message out again once the visibility timeout passes. It must exceed the task time limit, or
# a task still running would be handed to a second worker (kombu's default is one hour).
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", CELERY_TASK_TIME_LIMIT + 30),
    # How often a worker looks for messages a dead worker took and never acknowledged (past
    # the visibility timeout): kombu's default scans on every 10th sweep of 10 s, so a task
    # of a killed worker waited up to 100 s more; one scan of the unacked index every 10 s.
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
}
if CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"] <= CELERY_TASK_TIME_LIMIT:
    raise ImproperlyConfigured(
        f"CELERY_VISIBILITY_TIMEOUT must exceed CELERY_TASK_TIME_LIMIT ({CELERY_TASK_TIME_LIMIT} s)"
    )
CELERY_TIMEZONE = TIME_ZONE

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["base.permissions.IsOperatorOrReadOnly"],
    "DEFAULT_FILTER_BACKENDS": [
        "base.filters.BoundedFilterBackend",
        "rest_framework.filters.OrderingFilter",
        "rest_framework.filters.SearchFilter",
    ],
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.parsers.SafeJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.StandardPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "base.schema.BatonAutoSchema",
    "EXCEPTION_HANDLER": "controlplane.exceptions.api_exception_handler",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Baton control plane API",
    "DESCRIPTION": (
        "Provision and observe a cross-datacenter PDD (Prefill - RelayDecode - MainDecode) "
        "inference fleet: datacenters, GPU types, unit prices, WAN links, served models, nodes "
        "and engine instances."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and its docs: anyone in development, signed-in users in production.
    "SERVE_PERMISSIONS": [
        "rest_framework.permissions.IsAuthenticated"
        if PRODUCTION
        else "rest_framework.permissions.AllowAny"
    ],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # One tag per app (base/schema.py tags the operations), in the docs' order.
    "TAGS": [
        {"name": "openai", "description": "The OpenAI-compatible gateway (/v1), for tenants."},
        {
            "name": "fleet",
            "description": "Datacenters, GPU types, unit prices, WAN links, served models, "
            "nodes and engine instances.",
        },
        {"name": "routing", "description": "Request records, routing decisions and policy."},
        {"name": "billing", "description": "Tenants, API keys, prices, usage and statements."},
        {
            "name": "organization",
            "description": "A tenant's own usage and statements (/v1/organization), with the "
            "tenant's API key.",
        },
        {"name": "planner", "description": "Capacity-planning and sizing runs, the autopilot."},
        {"name": "agents", "description": "Node agents' registration and heartbeats."},
    ],
    # The gateway's /v1 operations and a tenant's /v1/organization ones (plain Django views
    # drf-spectacular cannot see).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "routing.gateway.openapi.add_gateway_paths",
        "billing.tenant_openapi.add_tenant_paths",
    ],
    "ENUM_NAME_OVERRIDES": {
        "NodeStatusEnum": "fleet.choices.NodeStatus",
        "LinkStatusEnum": "fleet.choices.LinkStatus",
        "InstanceRoleEnum": "fleet.choices.InstanceRole",
        "DesiredStateEnum": "fleet.choices.DesiredState",
        "ActualStateEnum": "fleet.choices.ActualState",
        "PlanRunStatusEnum": "fleet.choices.PlanRunStatus",
        "ProposalStatusEnum": "plans.models.ProposalStatus",
        "ProposalStepStatusEnum": "plans.models.StepStatus",
    },
}

# Agents: heartbeat period, and how many missed beats make a node offline.
BATON_HEARTBEAT_INTERVAL_S = float(env_str("BATON_HEARTBEAT_INTERVAL_S", "2.0"))
BATON_HEARTBEAT_MISSES = env_int("BATON_HEARTBEAT_MISSES", 3)
# A node's report older than the live TTL (interval x misses) but younger than the TTL plus
# this is "late", not lost, while the node is online: a request that finds no healthy path
# only because of late reports waits in the overload queue and is routed again, instead of a
# 503 (a control plane too busy to take the beats in time; fleet/live.py, routing/live.py).
BATON_LIVE_LATE_S = env_float(
    "BATON_LIVE_LATE_S", BATON_HEARTBEAT_INTERVAL_S * BATON_HEARTBEAT_MISSES, minimum=0.0
)
# The agent probe (routing/probes.py) asks a node's agent for /health only once its last
# heartbeat is this old (unset: 1.25 heartbeat intervals; 0: every node, every round).
BATON_PROBE_AFTER_S = (
    float(env_str("BATON_PROBE_AFTER_S", "")) if env_str("BATON_PROBE_AFTER_S", "") else None
)
# A node's live-view entry (fleet/live.py) is rewritten when its report changes, and at least
# this often for the agent's own heartbeat stats; its liveness moves at every beat.
BATON_LIVE_REFRESH_S = float(env_str("BATON_LIVE_REFRESH_S", "10.0"))
# A heartbeat that changes nothing since the node's last full one is taken on a fast path (no
# validation, no locks, batched writes) for up to this long (between half of it and all of it,
# at random per node); then one full heartbeat again (fleet/agent_services.py, fleet/beats.py).
# At 1,000 nodes, 10 s meant 100 full beats a second, more than one web process serves.
BATON_HEARTBEAT_FULL_EVERY_S = float(env_str("BATON_HEARTBEAT_FULL_EVERY_S", "60.0"))
# The web process's GIL switch interval (sys.setswitchinterval), in milliseconds. Its event
# loop takes the heartbeats' fast path and the gateway's streams while page renders and full
# heartbeats compute on threads; each time the loop wants the GIL back from a computing thread
# it waits up to this long, at every turn of the loop. CPython's 5 ms capped the loop at ~200
# turns a second whenever a page rendered (bench/control_path/REPORT.md).
# 0 keeps CPython's default.
BATON_GIL_SWITCH_INTERVAL_MS = env_float("BATON_GIL_SWITCH_INTERVAL_MS", 0.5, minimum=0.0)
# A garbage collection in the web process at least this long is logged (controlplane/gcwatch.py):
# it stops the event loop for as long. 0: never.
BATON_GC_WARN_MS = env_float("BATON_GC_WARN_MS", 50.0, minimum=0.0)
# The web process's collector thresholds (gc.set_threshold: the young generation's, then the
# older ones'), comma-separated; empty: CPython's (700,10,10). And whether it freezes what
# start-up allocated (gc.freeze). controlplane/gcwatch.py says why.
BATON_GC_THRESHOLDS = env_int_list("BATON_GC_THRESHOLDS", [50_000, 10, 10], count=3)
BATON_GC_FREEZE = env_bool("BATON_GC_FREEZE", True)
# Requests of the agents' API that Django serves at once per web process; more wait on the
# event loop (a burst must not hold threads and pooled connections past the pool's timeout).
BATON_AGENT_API_CONCURRENCY = env_int("BATON_AGENT_API_CONCURRENCY", 16)
BATON_AGENT_API_QUEUE_TIMEOUT_S = env_float("BATON_AGENT_API_QUEUE_TIMEOUT_S", 5.0, minimum=0.0)
# An agents' API call (a heartbeat, a registration) answered slower than this is logged with
# where its time went ("baton.agent_api"): a late heartbeat ages its node's report.
BATON_AGENT_API_SLOW_S = env_float("BATON_AGENT_API_SLOW_S", 2.0, minimum=0.0)
BATON_RECONCILE_INTERVAL_S = float(env_str("BATON_RECONCILE_INTERVAL_S", "5.0"))
# The periodic reconcile asks only the agents whose last heartbeat differs from what operators
# want; every this often it asks every online node's agent (fleet/tasks.py reconcile_fleet).
BATON_RECONCILE_FULL_EVERY_S = float(env_str("BATON_RECONCILE_FULL_EVERY_S", "60.0"))
# Gateway fault limits (docs/faults.md). A stream with tokens out that goes this long without
# one (or 10 x its median gap, if more) has a frozen decoder and migrates; an attempt with no
# token yet fails over to another path after the first-token timeout.
BATON_GATEWAY_STALL_S = env_float("BATON_GATEWAY_STALL_S", 1.6, minimum=0.05)
BATON_GATEWAY_FIRST_TOKEN_TIMEOUT_S = env_float(
    "BATON_GATEWAY_FIRST_TOKEN_TIMEOUT_S", 60.0, minimum=0.1
)
# Overload (docs/gateway.md "Overload"): a request an engine has no room for now waits at the
# gateway, routed again as capacity frees, up to this long; at most this many wait in a
# process, and at most this many of one tenant (fair share). Past them: 503 / 429 with
# Retry-After, as a status code when no token has been sent.
BATON_GATEWAY_QUEUE_TIMEOUT_S = env_float("BATON_GATEWAY_QUEUE_TIMEOUT_S", 60.0, minimum=0.0)
# A request P's engine has queued (P's stream says "queued" every few seconds: busy, not
# frozen) waits there for its first token up to this long; then the gateway lets it go (P
# drops it) and answers 503 `overloaded` with Retry-After.
BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S = env_float(
    "BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S", 300.0, minimum=1.0
)
BATON_GATEWAY_QUEUE_MAX = env_int("BATON_GATEWAY_QUEUE_MAX", 512)
BATON_GATEWAY_QUEUE_PER_TENANT = env_int("BATON_GATEWAY_QUEUE_PER_TENANT", 128)
# Connections a gateway process holds to each agent at once: one per stream in flight.
BATON_GATEWAY_MAX_AGENT_CONNECTIONS = env_int("BATON_GATEWAY_MAX_AGENT_CONNECTIONS", 4096)
# One hop per token: P ends its stream with the decoding role's (a `continue` event) and the
# gateway reads MD's or RLD's stream itself. false: P relays the decoder's tokens (as before).
BATON_GATEWAY_DIRECT_STREAMS = env_bool("BATON_GATEWAY_DIRECT_STREAMS", default=True)
# Stream chunks coalesce under load (routing/gateway/coalesce.py): with at least
# BATON_GATEWAY_COALESCE_FROM streams open in the process, a chunk waits up to the interval for
# more tokens to join it; below, each read from the agent is written at once. 0: off.
BATON_GATEWAY_STREAM_INTERVAL_S = env_float("BATON_GATEWAY_STREAM_INTERVAL_S", 0.02, minimum=0.0)
BATON_GATEWAY_COALESCE_FROM = env_int("BATON_GATEWAY_COALESCE_FROM", 64)
# Admission and routing on the event loop, without a worker-thread hop, when the whole hot
# path is in memory (no REDIS_URL) and every read is a cache hit (routing/gateway/views.py).
BATON_GATEWAY_INLINE = env_bool("BATON_GATEWAY_INLINE", default=True)
# A batch of request records whose commit fails on its connection (a database restart, no
# pooled connection free, a deadlock's victim) is tried again, in order, for this long before
# the writer gives up on it (routing/gateway/workers.py: BatchWriter).
BATON_RECORD_RETRY_S = env_float("BATON_RECORD_RETRY_S", 300.0, minimum=0.0)
# Fleet-wide data-plane token: handed to agents at registration and sent by the gateway on
# every call to an agent's data endpoints. Empty: the data plane is open (private network).
BATON_DATA_TOKEN = env_str("BATON_DATA_TOKEN", "")
if BATON_DATA_TOKEN:
    try:
        check_data_token(BATON_DATA_TOKEN, "BATON_DATA_TOKEN")
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None
# Networks agent endpoints may live in (CIDRs, comma-separated). Registration, an operator's
# edit and every call the control plane makes to an agent check the endpoint against them;
# link-local and cloud metadata addresses are refused whatever this says.
BATON_AGENT_NETWORKS = env_list(
    "BATON_AGENT_NETWORKS",
    ["127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"],
)
# The gateway's calls to agents (and the probe's) connect only to an address just checked
# against those networks: an endpoint's name is resolved again once it is this old (seconds;
# 0: before every request), so a DNS answer that changed is never trusted for long
# (fleet/pinning.py). The control plane's commands resolve before every call.
BATON_AGENT_RESOLVE_TTL_S = env_float("BATON_AGENT_RESOLVE_TTL_S", 5.0)
# Without a broker the ASGI process runs the beat schedule itself (see embedded_beat.py).
BATON_EMBEDDED_BEAT = env_bool("BATON_EMBEDDED_BEAT", default=True)
CELERY_BEAT_SCHEDULE = {
    "fleet-health-check": {"task": "fleet.health_check", "schedule": BATON_HEARTBEAT_INTERVAL_S},
    # Dead or frozen agents routed around within one heartbeat interval (routing/probes.py).
    "routing-probe-agents": {
        "task": "routing.probe_agents",
        "schedule": BATON_HEARTBEAT_INTERVAL_S,
    },
    "fleet-reconcile": {"task": "fleet.reconcile_fleet", "schedule": BATON_RECONCILE_INTERVAL_S},
    "billing-close-statements": {"task": "billing.close_statements", "schedule": 300.0},
    # Requests a killed gateway process left half-done: recorded as "interrupted".
    "routing-finish-interrupted": {"task": "routing.finish_interrupted", "schedule": 30.0},
    # The autopilot (plans/autopilot.py): applies approved proposals step by step, records
    # realised figures, proposes on its own interval and, in automatic mode, approves.
    "plans-autopilot-tick": {"task": "plans.autopilot_tick", "schedule": 10.0},
}

# Roles: members of this group (or staff) may write; every other authenticated user reads.
BATON_OPERATOR_GROUP = "operator"
BATON_VIEWER_GROUP = "viewer"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
