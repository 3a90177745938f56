"""Deployment as code: the Grafana dashboard's generator and the containers' health check (docker-compose.yml)."""
