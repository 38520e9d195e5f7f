"""The live view of the KV cache: `GET /dashboard` (a page), `/dashboard/state` (a JSON snapshot) and
`/dashboard/events` (server-sent snapshots). See routes.py; docs/serving.md describes the endpoints."""
