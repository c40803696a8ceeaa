import pytest

from shared import model_store
from shared.worker.settings import WorkerSettings


def test_the_default_model_is_the_smollm2_gguf():
    path = model_store.default_model_path()
    assert path.name == model_store.DEFAULT_GGUF and path.exists()


def test_a_hugging_face_directory_is_used_as_it_is(model_dir, tmp_path):
    assert model_store.prepare(str(model_dir), str(tmp_path)) == model_dir
    assert not any(tmp_path.iterdir())  # nothing converted


def test_the_gguf_conversion_is_cached(model_dir):
    assert model_store.prepare("", str(model_dir.parent)) == model_dir


def test_missing_models_are_a_clear_error(tmp_path):
    with pytest.raises(model_store.ModelNotFound):
        model_store.prepare(str(tmp_path / "nope.gguf"), str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(model_store.ModelNotFound):
        model_store.prepare(str(tmp_path / "weights.bin"), str(tmp_path))


@pytest.mark.parametrize("worker_id", ["*", ">", "a.b", "x y", "a" * 65])
def test_worker_ids_cannot_break_nats_subjects(worker_id):
    with pytest.raises(ValueError):
        WorkerSettings(worker_id=worker_id)
