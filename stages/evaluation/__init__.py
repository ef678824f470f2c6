"""The evaluation stage's parts (stages/evaluate.py runs them):

    plan.py      the rows (data prep's split or the user's files whole), which metrics they allow,
                 model names; every data problem raised before a model loads (torch-free)
    scoring.py   per model on this rank's batches: generation, verifier scores, completion NLL,
                 preference-pair log-probs, judge log-likelihoods; gathered over ranks
    metrics.py   per-row records -> metrics, breakdowns by group, pass@k, win rates, selection
                 (torch-free)
    outputs.py   results.json, samples.json, the manifest, MLflow (a nested run per model, tables)

Metric keys (the same in results.json, the manifest and MLflow, where MLflow's key rules turn
'@' and '=' into '_'): exact_match, normalized_match, reward, pass@<k>, perplexity, nll,
preference_accuracy, win_rate/<other model> (models[0]; each other model gets win_rate/<models[0]>
= 1 - that), and `<key>/<group_by>=<value>` for every group value of the rows.
"""
