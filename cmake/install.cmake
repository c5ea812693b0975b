# strata as a CMake package: `cmake --install build --prefix P` installs the libraries, their
# headers and P/lib/cmake/strata/strataConfig.cmake, so that an outside project can
#   find_package(strata REQUIRED)   # with P (and LibTorch's prefix, for strata::bridge) searched
#   target_link_libraries(app PRIVATE strata::optim strata::policies strata::bridge)
# (examples/cpp_consumer/ is one). Targets: strata::base, strata::allocator, strata::runtime,
# strata::policies, strata::optim and, with LibTorch, strata::bridge.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(strata_installed strata_options strata_base strata_allocator strata_runtime strata_policies
                     strata_optim)
if(STRATA_WITH_TORCH)
  list(APPEND strata_installed strata_bridge)
endif()
foreach(t IN LISTS strata_installed)
  string(REGEX REPLACE "^strata_" "" short ${t})
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${short})
endforeach()

install(TARGETS ${strata_installed} EXPORT strataTargets COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# The public headers: what a user includes (the runtime, the policies, Adam, the allocator, the
# status macros and, with LibTorch, the bridge) and what they include in turn. The runtime's rooms
# (runtime_impl.h, registry, migration, staging, entries, copy traces) and the bridge's binding
# state stay inside. Configuring fails if a public header includes one of strata's headers that is
# not in the list, so the installed tree always compiles.
set(strata_public_headers
    base/serial_worker.h base/status.h base/strings.h base/thread_pool.h base/units.h
    allocator/block_pool.h allocator/budget.h allocator/stats.h allocator/stream_ops.h
    allocator/tier.h allocator/tiered_allocator.h allocator/upstream.h
    runtime/device.h runtime/policy.h runtime/runtime.h runtime/step_costs.h runtime/tensor.h
    runtime/undo_memory.h
    policies/builtin.h policies/step_cost_model.h
    optim/adam.h optim/adam_kernels.h optim/adam_math.h optim/adam_slot.h optim/state_codec.h
    optim/host_speculation.h optim/kept_states.h optim/state_decl.h
    optim/lion_kernels.h optim/lion_math.h optim/step_rates.h optim/step_rule.h optim/step_tensor.h)
if(STRATA_WITH_TORCH)
  list(APPEND strata_public_headers bridge/grad_stats.h bridge/model_hooks.h bridge/scalar_reader.h
       bridge/status.h bridge/torch_runtime.h)
endif()
foreach(header IN LISTS strata_public_headers)
  file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/${header} includes REGEX "^#include \"[^\"]+\"")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" included "${line}")
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${included} AND NOT included IN_LIST
                                                           strata_public_headers)
      message(FATAL_ERROR "${header} is installed but includes ${included}, which is not: add it "
                          "to strata_public_headers in cmake/install.cmake, or keep it out of "
                          "${header}")
    endif()
  endforeach()
  get_filename_component(dir ${header} DIRECTORY)
  install(FILES ${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${dir} COMPONENT dev)
endforeach()
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata
        COMPONENT dev)
configure_package_config_file(cmake/strataConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/strataConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/strataConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/strataConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata COMPONENT dev)
