"""The Demucs engine's room: what the worker needs to run a Demucs model.

`models.py` knows the pretrained models' files and the cache (pull, verify, import),
`catalogue.py` what each model is for; `chunked.py` separates a song of any length in bounded
memory with the result of one whole-song pass, `inverse.py` is HTDemucs's last step with one
copy instead of three, and `precision.py` chooses by measuring the precision a loaded model
runs in. The worker process that runs it (and the RoFormer, for a recipe) is `worker.py`,
one room up; the model's compiled form is in `compiled/`.
"""
