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
set(strata_header_dirs base allocator runtime policies optim)
if(STRATA_WITH_TORCH)
  list(APPEND strata_header_dirs bridge)
endif()
foreach(dir IN LISTS strata_header_dirs)
  install(DIRECTORY ${dir} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev
          FILES_MATCHING PATTERN "*.h")
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
