"""looprl.programs: compiled programs are dropped before the process nears the map limit."""
import jax
import jax.numpy as jnp

from looprl.programs import memory_maps, release_programs_near_map_limit


def test_programs_are_dropped_only_past_the_soft_limit():
    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.arange(4.0))
    assert f._cache_size() == 1
    maps = memory_maps()
    assert maps is not None and maps > 0  # Linux: the suite runs where /proc exists
    assert release_programs_near_map_limit(soft_limit=maps + 10_000) is False
    assert f._cache_size() == 1
    assert release_programs_near_map_limit(soft_limit=0) is True
    assert f._cache_size() == 0
    assert f(jnp.arange(4.0)).tolist() == [1.0, 4.0, 7.0, 10.0]
