-- Runs once, when the PostgreSQL volume is first initialised (docker-entrypoint-initdb.d).
-- POSTGRES_DB creates `tidal` (the platform database, migrated by Alembic); each service gets its own.
CREATE DATABASE prefect OWNER tidal;
CREATE DATABASE mlflow OWNER tidal;
CREATE DATABASE optuna OWNER tidal;
