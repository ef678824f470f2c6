-- The MLflow backend store lives beside Prefect's database on the same server.
CREATE DATABASE mlflow;
