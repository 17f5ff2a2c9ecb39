"""The tests marked ``slow`` (tests/conftest.py applies the marker): every test function whose cases took
0.5 s or more together in `pytest -m "not vllm and not arm" --durations=0` on the 2-core AMD EPYC Zen 3 dev VM
(2026-12-07, a loaded machine: the figures are wall seconds, setup included), so that `make check`
(-m "not vllm and not arm and not emulated and not slow") stays within about 3 minutes. Keyed by file name
and function, not folder. tests/support/test_slow_list.py checks that each one exists."""

SLOW = {
    "test_arm_mxfp4.py::test_arm_target_mxfp4_pack_converts_and_verifies_on_x86": 9.5,  # 3 cases
    "test_arm_mxfp4.py::test_pack_experts_arm_runs_here_on_scalar_against_the_reference": 1.5,  # 2 cases
    "test_bench.py::test_bench_divides_by_the_peak_of_the_kernels_instruction": 1.6,  # 1 case
    "test_bench.py::test_bench_rows_carry_the_plain_read_baseline": 1.6,  # 2 cases
    "test_bench.py::test_cli_bench_compare": 1.0,  # 1 case
    "test_bench_vs.py::test_reexec_refuses_another_torch": 3.7,  # 1 case
    "test_bench_vs.py::test_reexec_runs_the_cli_in_another_python": 17.6,  # 1 case
    "test_bench_vs.py::test_schemes_an_engine_lacks_are_left_out_with_a_note": 3.5,  # 1 case
    "test_bench_vs.py::test_vs_torch_quantized_runs_the_dequantized_weights": 29.6,  # 2 cases
    "test_bench_vs.py::test_vs_torch_rows_ratios_json_and_compare": 46.4,  # 1 case
    "test_bench_vs.py::test_zentorch_adapter_logic_without_zentorch": 1.9,  # 2 cases
    "test_cli_packdir.py::test_convert_json": 0.7,  # 1 case
    "test_cli_packdir.py::test_convert_prints_a_summary": 1.4,  # 1 case
    "test_cli_packdir.py::test_convert_shard_size_and_threads": 1.9,  # 1 case
    "test_cli_packdir.py::test_exit_codes": 1.2,  # 1 case
    "test_cli_packdir.py::test_python_m_moepack": 24.5,  # 1 case
    "test_cli_packdir.py::test_verify_text_and_json": 1.1,  # 1 case
    "test_cli_packdir.py::test_verify_with_source_json": 0.5,  # 1 case
    "test_container.py::test_open_is_zero_copy": 1.0,  # 1 case
    "test_convert.py::test_convert_streams_one_layer_at_most": 10.4,  # 1 case
    "test_convert.py::test_convert_then_verify": 10.1,  # 12 cases
    "test_convert.py::test_experts_match_transformers": 9.6,  # 12 cases
    "test_convert.py::test_forward_matches_transformers_block": 10.0,  # 12 cases
    "test_convert_resume.py::test_a_hangup_under_nohup_does_not_stop_the_convert": 5.0,  # 1 case
    "test_convert_resume.py::test_cli_resume_flag_and_note": 41.2,  # 1 case
    "test_convert_resume.py::test_in_place_source_edit_with_mtime_restored_is_not_resumed": 17.4,  # 1 case
    "test_convert_resume.py::test_kill9_then_resume_is_byte_identical": 86.3,  # 4 cases
    "test_convert_resume.py::test_live_run_is_left_alone_and_a_second_writer_refused": 11.9,  # 1 case
    "test_convert_resume.py::test_parallel_and_serial_write_the_same_bytes": 3.6,  # 1 case
    "test_convert_resume.py::test_sigterm_and_sighup_leave_nothing": 11.5,  # 2 cases
    "test_convert_resume.py::test_stale_temp_of_another_plan_is_removed": 25.8,  # 1 case
    "test_cpp_kernels.py::test_cpp_kernels": 206.1,  # 1 case
    "test_dispatch.py::test_decode_streams_choice_override_and_refusal": 14.0,  # 1 case
    "test_dispatch.py::test_max_isa_can_only_lower": 0.6,  # 144 cases
    "test_dispatch.py::test_mx4_a16_dot_choice_override_and_refusal": 16.9,  # 1 case
    "test_dispatch.py::test_strict_never_refuses_on_this_host": 1.8,  # 18 cases
    "test_errors.py::test_a_meta_tensor_beside_cpu_hidden_states_is_refused": 2.2,  # 4 cases (added with the test, measured loaded)
    "test_family_sweep.py::test_family": 19.6,  # 59 cases (stop 54, quiet: the whole-suite run)
    "test_family_sweep.py::test_family_entry_matches_transformers": 49.0,  # 50 cases (t48e, measured on the shared VM; 53 since t48f)
    "test_float_shared.py::test_a_quantized_shared_expert_keeps_its_scheme": 1.1,  # 1 case
    "test_float_shared.py::test_a_tp_pack_keeps_the_float_shared_expert_and_version_5": 1.2,  # 1 case
    "test_float_shared.py::test_an_older_pack_that_quantized_it_unasked_fails_verify": 0.5,  # 1 case
    "test_float_shared.py::test_cli_convert_says_what_it_did_with_the_shared_experts": 0.8,  # 1 case
    "test_float_shared.py::test_f16_shared_expert_packed_when_exact_refused_when_not": 2.7,  # 1 case
    "test_float_shared.py::test_float_shared_expert_stays_float": 15.7,  # 4 cases
    "test_float_shared.py::test_layer_equals_the_checkpoint_meaning_and_quantize_is_the_one_way": 7.8,  # 4 cases
    "test_float_shared.py::test_run_experts_and_load_model_use_the_float_shared_expert": 0.8,  # 1 case
    "test_float_shared.py::test_the_manifest_rules_of_a_shared_layout": 6.0,  # 4 cases (the module's sources written, setup)
    "test_format_versions.py::test_a_version_1_directory_opens_and_verifies": 5.8,  # 4 cases
    "test_format_versions.py::test_a_version_2_layout_must_match_this_build_in_every_field": 0.7,  # 3 cases
    "test_fp8.py::test_both_layouts_scalar_and_every_simd_level": 11.2,  # 16 cases
    "test_fp8.py::test_codes_and_scales_sit_where_the_layout_says": 0.9,  # 8 cases
    "test_fp8.py::test_pack_experts_on_float_weights_quantizes_and_round_trips": 3.4,  # 1 case
    "test_fp8.py::test_pack_refuses_bad_canonical_tensors": 1.0,  # 6 cases
    "test_fp8.py::test_scalar_matches_fp8_reference": 19.3,  # 45 cases
    "test_fp8_convert.py::test_an_fp8_source_is_never_requantized": 0.6,  # 1 case
    "test_fp8_convert.py::test_cli_convert_verify_run_bench": 6.5,  # 1 case
    "test_fp8_convert.py::test_convert_verify_and_inspect": 58.1,  # 6 cases
    "test_fp8_convert.py::test_float_shared_expert_in_an_fp8_source": 3.0,  # 1 case
    "test_fp8_convert.py::test_mixtral_names_w1_w3_w2": 1.1,  # 1 case
    "test_fp8_convert.py::test_packed_layers_match_transformers_on_the_oracle_weights": 6.0,  # 6 cases
    "test_fp8_convert.py::test_quantize_fp8_from_float": 4.3,  # 4 cases
    "test_fp8_convert.py::test_tampered_codes_and_scales_fail_verify": 5.4,  # 3 cases
    "test_fp8_kernels.py::test_both_layouts_on_every_level": 38.0,  # 40 cases
    "test_fp8_kernels.py::test_scalar_matches_reference": 9.9,  # 45 cases
    "test_fp8_kernels.py::test_simd_matches_scalar": 4.0,  # 45 cases
    "test_fp8_model.py::test_block_quantization_against_the_format_and_transformers": 1.2,  # 30 cases
    "test_fp8_model.py::test_container_carries_fp8_tensors_unchanged": 1.5,  # 1 case
    "test_fp8_model.py::test_mtp_layer_packed_as_moe_is_skipped_and_recorded": 9.7,  # 1 case
    "test_fp8_model.py::test_whole_deepseek_v3_fp8_model": 5.4,  # 2 cases
    "test_fp8_model.py::test_writer_cli_and_refusals": 5.6,  # 1 case
    "test_fp8_sources.py::test_bad_tensors_are_refused_by_name": 1.0,  # 9 cases
    "test_fp8_sources.py::test_block_fp8_reader_matches_transformers_dequantization": 3.2,  # 3 cases
    "test_fp8_sources.py::test_ct_float_quantized_reader_matches_compressed_tensors": 11.2,  # 3 cases
    "test_fp8_sources.py::test_every_code_decodes_through_the_reader": 0.6,  # 1 case
    "test_fp8_sources.py::test_weight_block_size_absent_or_null_as_transformers_reads_it": 1.4,  # 1 case
    "test_int4.py::test_every_group_size_on_every_level": 120.6,  # 48 cases
    "test_int4.py::test_expert_map_and_threads": 0.6,  # 1 case
    "test_int4.py::test_pack_experts_on_float_weights_quantizes": 1.0,  # 1 case
    "test_int4.py::test_scalar_matches_int4_reference": 19.2,  # 45 cases
    "test_int4.py::test_simd_matches_scalar_int4": 5.1,  # 90 cases
    "test_int4_actorder.py::test_gptq_act_order_converts_verifies_and_runs": 12.7,  # 4 cases
    "test_int4_actorder.py::test_identity_perm_is_the_unpermuted_path_bit_for_bit": 1.7,  # 2 cases
    "test_int4_actorder.py::test_kernels_run_act_order_on_every_level": 6.2,  # 4 cases
    "test_int4_actorder.py::test_opcheck_with_a_perm": 3.0,  # 1 case
    "test_int4_convert.py::test_act_mode_refusals_and_w4a8_default": 1.4,  # 1 case
    "test_int4_convert.py::test_cli_convert_verify_inspect_run_with_act_modes": 2.6,  # 1 case
    "test_int4_convert.py::test_fixture_converts_verifies_and_matches_transformers": 13.5,  # 3 cases
    "test_int4_convert.py::test_verify_catches_a_tampered_zero_point_or_perm": 24.4,  # 4 cases
    "test_int4_convert.py::test_written_checkpoint_converts_verifies_and_matches_transformers": 27.7,  # 5 cases
    "test_int4_sources.py::test_awq_exact_and_matches_autoawq_converter": 1.9,  # 6 cases
    "test_int4_sources.py::test_ct_reader_matches_compressed_tensors_decompression": 0.9,  # 3 cases
    "test_int4_sources.py::test_ct_synthetic_shapes_exact": 1.0,  # 5 cases
    "test_int4_sources.py::test_gptq_exact": 10.9,  # 32 cases
    "test_int8.py::test_bench_int8_scheme": 3.2,  # 1 case
    "test_int8.py::test_block_accumulators_are_identical": 1.5,  # 36 cases
    "test_int8.py::test_cpp_packer_equals_python_spec": 0.5,  # 5 cases
    "test_int8.py::test_meta_and_opcheck_int8": 1.5,  # 1 case
    "test_int8.py::test_scalar_matches_int8_reference": 30.8,  # 45 cases
    "test_int8.py::test_simd_matches_scalar_int8": 1.2,  # 45 cases
    "test_int8.py::test_thread_count_and_expert_map": 1.7,  # 2 cases
    "test_int8_colsum.py::test_wrong_stored_column_sums_change_no_level": 0.6,  # 1 case
    "test_int8_convert.py::test_bad_tensors_are_refused_by_name": 0.7,  # 10 cases
    "test_int8_convert.py::test_convert_verify_open": 2.1,  # 5 cases
    "test_int8_convert.py::test_gpt_oss_rows_are_reinterleaved": 0.6,  # 1 case
    "test_int8_convert.py::test_inspect_and_cli": 0.6,  # 1 case
    "test_int8_convert.py::test_mixtral_names": 0.5,  # 1 case
    "test_isa_list.py::test_check_detects_a_stale_file": 2.1,  # 4 cases
    "test_isa_list.py::test_setup_builds_the_listed_files": 7.8,  # 1 case
    "test_isa_list.py::test_setup_refuses_a_missing_level_file": 6.0,  # 1 case
    "test_isa_list.py::test_setup_refuses_an_unlisted_kernel_file": 8.5,  # 1 case
    "test_kernels.py::test_expert_map_entries_out_of_range": 4.5,  # 81 cases
    "test_kernels.py::test_expert_map_identity_equals_no_map": 3.6,  # 27 cases
    "test_kernels.py::test_expert_parallel_ranks_sum_to_single_rank": 6.5,  # 24 cases
    "test_kernels.py::test_intermediate_is_rounded_to_the_activation_dtype": 0.8,  # 24 cases
    "test_kernels.py::test_large_output_is_streamed": 14.5,  # 4 cases
    "test_kernels.py::test_out_of_range_global_ids_with_expert_map": 4.7,  # 81 cases
    "test_kernels.py::test_out_of_range_ids_raise_index_error": 9.2,  # 162 cases
    "test_kernels.py::test_output_cast_is_round_to_nearest_even": 1.1,  # 6 cases
    "test_kernels.py::test_row_strided_hidden_states": 11.4,  # 81 cases
    "test_kernels.py::test_scalar_matches_reference": 1.5,  # 45 cases
    "test_kernels.py::test_thread_count_does_not_change_the_result": 73.0,  # 108 cases
    "test_kernels.py::test_zero_tokens_returns_empty": 11.2,  # 162 cases
    "test_layout_sync.py::test_check_detects_a_changed_table": 0.7,  # 1 case
    "test_layout_sync.py::test_check_detects_a_stale_header": 2.0,  # 1 case
    "test_layout_sync.py::test_check_fails_without_a_header": 1.1,  # 1 case
    "test_layout_sync.py::test_generated_header_is_up_to_date": 1.1,  # 1 case
    "test_manifest.py::test_a_bent_manifest_is_refused_by_open_inspect_run_and_verify": 16.0,  # 39 cases
    "test_manifest_fuzz.py::test_bent_directories_are_refused_or_compute_the_same": 52.2,  # 1 case
    "test_manifest_fuzz.py::test_the_fuzzer_sees_a_silent_change": 0.6,  # 1 case
    "test_memory.py::test_huge_page_copy_is_an_equal_contiguous_copy": 1.6,  # 4 cases
    "test_memory.py::test_pack_experts_huge_pages_change_no_byte": 22.4,  # 3 cases
    "test_mxfp4.py::test_a8_reference_against_the_fp32_pipeline": 1.5,  # 1 case
    "test_mxfp4.py::test_a_pack_copy_with_the_scales_intact_still_opens": 1.4,  # 1 case
    "test_mxfp4.py::test_cli_convert_inspect_verify_run_bench": 32.6,  # 1 case
    "test_mxfp4.py::test_codes_and_scales_sit_where_the_layout_says": 1.0,  # 6 cases
    "test_mxfp4.py::test_convert_act_mode_a8_verifies_in_a8": 1.2,  # 1 case
    "test_mxfp4.py::test_convert_quantize_mxfp4_from_float": 2.8,  # 2 cases
    "test_mxfp4.py::test_nan_scale_in_a_checksum_consistent_pack_is_refused": 1.1,  # 1 case
    "test_mxfp4.py::test_pack_experts_on_float_weights_through_the_kernels": 2.2,  # 4 cases
    "test_mxfp4_kernels.py::test_a16_random_rows_on_every_level": 0.7,  # 1 case
    "test_mxfp4_kernels.py::test_a8_folded_tiles_tell_the_orders_apart": 0.9,  # 1 case
    "test_mxfp4_kernels.py::test_every_code_and_exponent_exact_on_every_level": 2.3,  # 2 cases
    "test_mxfp4_kernels.py::test_exactness_with_the_other_a16_dot": 80.9,  # 1 case
    "test_mxfp4_kernels.py::test_extreme_exponents_every_code": 1.8,  # 12 cases
    "test_mxfp4_kernels.py::test_fused_every_level": 11.4,  # 8 cases
    "test_mxfp4_kernels.py::test_fused_expert_map": 1.5,  # 1 case
    "test_mxfp4_model.py::test_generate_cli_on_a_gpt_oss_mxfp4_pack": 3.3,  # 1 case
    "test_mxfp4_model.py::test_gpt_oss_mxfp4_a8_runs_close_to_a16": 9.4,  # 1 case
    "test_mxfp4_model.py::test_whole_compressed_tensors_mxfp4_model": 8.2,  # 1 case
    "test_mxfp4_model.py::test_whole_gpt_oss_mxfp4_model": 11.6,  # 1 case
    "test_mxfp4_model.py::test_whole_mxfp4_model_with_partial_groups": 12.1,  # 1 case
    "test_mxfp4_sources.py::test_bf16_and_mxfp4_gpt_oss_give_the_same_layer": 1.0,  # 1 case
    "test_mxfp4_sources.py::test_ct_bad_tensors_are_refused_by_name": 0.9,  # 5 cases
    "test_mxfp4_sources.py::test_ct_linearized_gpt_oss_is_re_interleaved": 2.0,  # 1 case
    "test_mxfp4_sources.py::test_ct_mxfp4_reader_matches_compressed_tensors": 2.6,  # 1 case
    "test_mxfp4_sources.py::test_ct_partial_last_group": 6.3,  # 1 case
    "test_mxfp4_sources.py::test_gpt_oss_bad_tensors_are_refused_by_name": 1.9,  # 10 cases
    "test_mxfp4_sources.py::test_gpt_oss_reader_matches_transformers_decoding": 1.1,  # 1 case
    "test_mxfp4_sources.py::test_transformers_loads_the_written_checkpoint": 0.7,  # 1 case
    "test_mxfp4_sources.py::test_writer_checkpoint_follows_formats_md": 1.4,  # 1 case
    "test_nvfp4_convert.py::test_cli_convert_inspect_verify_run_bench": 3.8,  # 1 case (stop 54, quiet)
    "test_nvfp4_model.py::test_whole_nvfp4_model": 2.6,  # 3 cases (stop 54, quiet; 6 since deepseek_v3 joined)
    "test_open.py::test_open_advises_its_maps_for_huge_pages": 1.2,  # 1 case
    "test_open.py::test_open_maps_instead_of_reading": 34.1,  # 2 cases
    "test_open.py::test_packed_directory_is_self_contained": 0.6,  # 1 case
    "test_ops.py::test_meta_pack_weight_gives_the_packed_codes_shape": 1.9,  # 18 cases
    "test_ops.py::test_meta_tensors_give_the_output_shape": 1.7,  # 54 cases
    "test_ops.py::test_opcheck_fused_experts": 14.0,  # 6 cases
    "test_ops.py::test_opcheck_pack_weight": 1.8,  # 3 cases
    "test_ops.py::test_opcheck_pack_weight_u4": 1.7,  # 2 cases
    "test_ops.py::test_torch_compile_fullgraph_matches_eager": 13.6,  # 1 case
    "test_pack.py::test_cpp_packer_equals_python_packer": 1.0,  # 48 cases
    "test_pack.py::test_cpp_u4_packer_equals_the_spec_byte_for_byte": 4.8,  # 80 cases
    "test_pack.py::test_pack_codes_puts_every_code_where_the_layout_says_and_matches_the_cpp_packer": 10.5,  # 72 cases
    "test_pack.py::test_pack_experts_cpp_equals_python": 1.9,  # 48 cases
    "test_pack.py::test_pack_experts_int4_cpp_equals_the_spec": 1.1,  # 1 case
    "test_pack.py::test_unpack_pack_round_trip_and_zero_padding": 0.9,  # 8 cases
    "test_packdir_errors.py::test_destination_exists": 0.6,  # 1 case
    "test_packdir_errors.py::test_flipped_data_byte_is_caught_by_verify": 0.7,  # 2 cases
    "test_packdir_errors.py::test_non_finite_weight_names_the_source_tensor": 1.9,  # 9 cases
    "test_probe.py::test_the_probe_binary_refuses_bad_arguments_and_keeps_to_its_budget": 1.7,  # 1 case
    "test_probe.py::test_the_probe_runs_quickly_on_a_tiny_buffer": 3.5,  # 1 case
    "test_quantize_int4.py::test_a_named_group_overrides_the_layout": 0.7,  # 1 case
    "test_quantize_int4.py::test_cli_options_summary_and_verify_table": 3.9,  # 1 case
    "test_quantize_int4.py::test_convert_verify_run": 7.7,  # 7 cases
    "test_quantize_int4.py::test_options_without_a_group_take_the_layout_asked_for": 2.6,  # 3 cases
    "test_quantize_int4.py::test_resume_key_holds_the_options": 23.5,  # 1 case
    "test_quantized_models.py::test_convert_refuses_an_attention_g_idx_that_is_not_a_grouping": 1.2,  # 1 case
    "test_quantized_models.py::test_convert_refuses_bad_values_in_a_quantized_attention_linear": 6.7,  # 5 cases
    "test_quantized_models.py::test_generate_cli_reports_the_dequantized_linears": 0.9,  # 1 case
    "test_quantized_models.py::test_whole_model_tokens_equal_transformers_on_the_dequantized_model": 18.8,  # 5 cases
    "test_routing.py::test_bench_smoke": 3.7,  # 1 case
    "test_routing.py::test_opcheck_route": 0.6,  # 8 cases
    "test_routing.py::test_route_matches_fixture_models": 1.2,  # 12 cases
    "test_routing.py::test_route_matches_reference": 19.4,  # 28 cases
    "test_routing.py::test_route_matches_transformers": 0.9,  # 13 cases
    "test_row_order.py::test_dense_any_activation_on_either_row_order": 0.9,  # 8 cases
    "test_scheme_docs.py::test_every_scheme_has_its_page_as_the_code_says": 3.6,  # 1 case (stop 54, quiet)
    "test_schemes.py::test_generic_modules_do_not_name_a_scheme": 1.1,  # 22 cases
    "test_tp.py::test_a_kill_in_the_reshard_phase_reuses_the_whole_pack": 33.8,  # 2 cases
    "test_tp.py::test_a_left_whole_pack_is_not_reused_when_stale": 100.3,  # 1 case
    "test_tp.py::test_a_second_tp_writer_is_refused_and_an_interrupt_leaves_nothing": 21.9,  # 1 case
    "test_tp.py::test_convert_tp2": 2.8,  # 2 cases
    "test_transformers.py::test_cli_generate_from_text_with_a_carried_tokenizer": 3.8,  # 1 case
    "test_transformers.py::test_cli_generate_json_matches_the_original": 3.4,  # 1 case
    "test_transformers.py::test_cli_generate_text_output": 2.4,  # 1 case
    "test_transformers.py::test_importing_moepack_hf_does_not_import_transformers": 5.1,  # 1 case
    "test_transformers.py::test_model_matches_original": 156.0,  # 29 cases
    "test_transformers.py::test_patch_frees_the_original_blocks": 1.5,  # 1 case
    "test_transformers.py::test_router_logits_and_aux_loss_are_recorded": 1.9,  # 2 cases
    "test_trust_cli_bounds.py::test_the_largest_accepted_values_run": 1.6,  # added with the test (measured loaded)
    "test_trust_cli_bounds.py::test_tokens_out_of_range_are_refused": 0.7,  # added with the test (measured loaded)
    "test_trust_config.py::test_true_configs_still_convert": 3.9,  # 1 case
    "test_trust_convert_rules.py::test_a_packed_fp8_scale_whose_products_overflow_is_refused": 0.6,  # added with the test (measured loaded)
    "test_trust_convert_rules.py::test_an_e8m0_scale_whose_weights_decode_to_inf_is_refused": 0.9,  # added with the test (measured loaded)
    "test_trust_convert_rules.py::test_convert_refuses_what_open_refuses_before_writing": 0.8,  # added with the test (measured loaded)
    "test_trust_convert_rules.py::test_verify_names_an_output_that_overflows": 3.9,  # added with the test (measured loaded)
    "test_trust_manifest_seal.py::test_act_mode_edited_with_its_option_is_refused_by_open_and_verify": 2.1,  # 1 case (measured loaded)
    "test_trust_manifest_seal.py::test_an_older_unsealed_manifest_opens_and_verify_notes_it": 0.5,  # 1 case (measured loaded)
    "test_trust_manifest_seal.py::test_convert_writes_a_sealed_version_6_manifest": 35.8,  # 1 case (the module's packs, setup; measured loaded)
    "test_trust_manifest_seal.py::test_every_field_a_run_reads_is_sealed": 0.8,  # 8 cases (the module's packs when run alone)
    "test_trust_manifest_verdict.py::test_convert_and_open_give_one_verdict_on_random_manifest_edits": 62.0,  # 120 examples (the module's packs, setup; measured loaded)
    "test_trust_manifest_verdict.py::test_convert_refuses_or_writes_a_pack_open_accepts": 20.0,  # 16 examples (measured loaded)
    "test_trust_manifest_verdict.py::test_the_mutations_reach_every_verdict": 1.0,  # 1 case (measured loaded)
    "test_trust_messages.py::test_an_unknown_dtype_word_is_refused_in_one_line": 0.6,  # 1 case
    "test_trust_messages.py::test_dtype_auto_converts_and_loads": 0.5,  # 1 case
    "test_trust_messages.py::test_layer_call_with_a_wrong_hidden_states_names_it": 0.8,  # 4 cases
    "test_trust_nan.py::test_a_non_finite_activation_gives_a_nan_row_on_every_level": 2.0,  # 6 cases
    "test_trust_nan.py::test_nan_in_nan_out_per_activation_scheme_mode_and_level": 67.0,  # 36 cases (measured loaded)
    "test_trust_swiglu_nan.py::test_a_nan_activation_gives_a_nan_row_on_every_level": 2.2,  # added with the test (measured loaded)
    "test_trust_swiglu_nan.py::test_a_tp_pack_run_whole_keeps_the_nan": 0.8,  # added with the test (measured loaded)
    "test_trust_tp_ranks.py::test_an_edit_of_rank_1s_copy_fails_both_verify_passes": 16.9,  # added with the test (measured loaded)
    "test_trust_verify.py::test_a_carried_file_and_its_checksum_edited_together_fail_against_the_source": 0.6,  # 1 case
    "test_trust_verify.py::test_a_deliberate_act_mode_passes_and_is_reported": 4.5,  # 1 case
    "test_trust_verify.py::test_a_hostile_int4_value_is_refused_by_open_and_verify": 0.8,  # 5 cases
    "test_trust_verify.py::test_a_widened_tolerance_is_reported": 3.3,  # 1 case
    "test_trust_verify.py::test_act_mode_switched_a16_to_a8_fails_verify": 4.4,  # 1 case
    "test_trust_verify.py::test_act_mode_switched_a8_to_a16_fails_verify": 4.0,  # 1 case
    "test_trust_verify.py::test_an_older_manifest_without_act_mode_option_is_reported_not_failed": 2.2,  # 1 case
    "test_trust_verify.py::test_deliberate_act_mode_erased_fails_verify": 1.3,  # 1 case
    "test_trust_verify.py::test_model_config_edit_fails_verify": 11.1,  # 3 cases
    "test_trust_verify.py::test_model_config_key_removed_fails_verify": 3.6,  # 1 case
    "test_trust_verify.py::test_verify_runs_the_manifests_mode_not_the_environments": 1.7,  # 1 case
    "test_variants.py::test_bench_on_an_untuned_host_names_tune_once": 12.1,  # added with the test (measured loaded)
    "test_variants.py::test_cli_tune_runs_shows_and_clears": 22.3,  # added with the test (measured loaded)
    "test_variants.py::test_env_variant_forces_and_is_checked": 8.4,  # added with the test (measured loaded)
    "test_variants.py::test_every_candidate_computes_the_defaults_bits": 9.5,  # added with the test (measured loaded)
    "test_variants.py::test_knobs_name_what_the_kernel_reads": 4.0,  # added with the test (measured loaded)
    "test_variants.py::test_tuner_keeps_the_faster_variant": 6.1,  # added with the test (measured loaded)
    "test_variants.py::test_tuner_never_keeps_a_slow_variant": 7.0,  # added with the test (measured loaded)
    "test_variants.py::test_vs_table_tool_prints_the_table": 39.2,  # added with the test (measured loaded)
    "test_verify_biases.py::test_a_changed_bias_fails_verify_by_name": 6.9,  # 8 cases
    "test_verify_biases.py::test_biases_are_compared_and_counted": 1.6,  # 2 cases
    "test_verify_model.py::test_a_carried_tensor_with_other_bytes_fails": 0.9,  # 1 case
    "test_verify_model.py::test_a_difference_is_named_at_its_expert_whatever_the_block": 0.9,  # 1 case
    "test_verify_model.py::test_a_pack_that_computes_another_model_fails_naming_the_difference": 9.1,  # 13 cases
    "test_verify_model.py::test_blocks_of_experts_give_the_same_verdict": 1.0,  # 1 case
    "test_verify_model.py::test_the_converted_packs_are_the_source_models": 2.8,  # 1 case
    "test_verify_model.py::test_verify_memory_does_not_grow_with_the_expert_count": 18.8,  # 1 case
    "test_verify_shared.py::test_a_changed_shared_element_fails_verify_by_name": 9.2,  # 13 cases
    "test_verify_shared.py::test_cli_names_the_changed_shared_tensor": 0.8,  # 1 case
    "test_verify_shared.py::test_cli_prints_the_shared_expert": 4.3,  # 1 case
    "test_verify_shared.py::test_compressed_tensors_source_with_a_shared_expert": 2.3,  # 2 cases
    "test_verify_shared.py::test_layers_without_a_shared_expert_report_none": 2.5,  # 1 case
    "test_verify_shared.py::test_verify_compares_and_counts_the_shared_expert": 9.3,  # 6 cases
}

# The files whose tests take the most CPU seconds together, run first (tests/conftest.py): tests/cpp
# (its two binaries built and run, ~250 CPU s of the main suite's ~1000) ended the main suite alone
# on one core when its file came up in the middle of the order (2026-12-07, Zen 3).
FIRST = ("test_cpp_kernels.py",)
